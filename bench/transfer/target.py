"""The receiving process of the transfer benchmark: a pre-touched buffer registered with one engine
(or a raw TCP listener), its description printed as `READY {json}`, then commands on stdin."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading

import numpy as np


def raw_listener(buf: np.ndarray) -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(buf)
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            n, got = int.from_bytes(head, "big"), 0
            while got < n:
                got += conn.recv_into(view[got:n])
            conn.sendall(b"k")

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def main() -> None:
    method, nbytes = sys.argv[1], int(sys.argv[2])
    buf = np.zeros(nbytes, dtype=np.uint8)
    buf[::4096] = 0  # touch every page now: first-touch faults would dominate the measurement
    if method == "raw":
        info = {"port": raw_listener(buf)}
    else:
        from tilert_serve import transfer

        engine = transfer.create(method, host="127.0.0.1", protocol="tcp", role="bench-target")
        engine.register(buf.ctypes.data, nbytes)
        info = {"peer": engine.peer_info(), "addr": buf.ctypes.data}
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "md5":
            print("R " + hashlib.md5(buf[: int(args[0])].tobytes()).hexdigest(), flush=True)
        elif cmd == "zero":
            buf[: int(args[0])] = 0
            print("R ok", flush=True)
        elif cmd == "quit":
            break
    os._exit(0)  # NIXL/UCX teardown can crash at exit


if __name__ == "__main__":
    main()
