"""TCP keepalive that tells a peer gone silent from a slow one, within seconds.

A peer whose process is killed on a live host resets its connections at once; one whose address goes
silent (a pod deleted with its network, a container killed with its network namespace, a machine
lost) leaves an open connection waiting until the caller's own timeout: the handoff sender's message
timeout (30 s), the router's idle-stream bound on a decode's stream. Keepalive probes every second
after one idle second, and a bound on unacknowledged data, turn that silence into an error
(ETIMEDOUT) after about SILENT_PEER_S seconds, whatever the caller waits for. A live peer's kernel
answers the probes however busy its process is, so a slow server is never cut off.
"""

from __future__ import annotations

import socket
from typing import Final

#: Seconds of silence (no answer to keepalive probes, or data unacknowledged) after which a
#: connection is dropped.
SILENT_PEER_S: Final = 4


def detect_silent_peer(sock: socket.socket, seconds: int = SILENT_PEER_S) -> None:
    """Set `sock` to fail after `seconds` of a silent peer (Linux; elsewhere, a developer's laptop,
    the caller's own timeouts alone bound the wait)."""
    options = [
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", max(seconds - 1, 1)),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", seconds * 1000),
    ]
    for level, name, value in options:
        if hasattr(socket, name):
            sock.setsockopt(level, getattr(socket, name), value)
