"""How many handoffs a prefill still has to send, where `tilert-pd wait-idle` (the pods' preStop hook)
can read it: one small file per vLLM worker process, `<dir>/sends-<pid>`, holding the count of the
worker's handoffs queued or in flight.

Why a file and not a gauge on vLLM's /metrics: the connector's stats reach /metrics only with an
engine step (vLLM collects them from each step's output), and a handoff outlives the step that queued
it (the request has finished and vLLM is idle while the sender still writes), so the gauge would stay
at its last non-zero value exactly when it matters. An endpoint would be a port inside vLLM, with a
credential to check. A file is local to the pod and needs neither: its directory is created 0700 and
each file 0600, so only the prefill's own user (the preStop hook runs as it) can read or plant one,
and a directory someone else owns or can write is refused. Files of processes that are gone (a worker
killed before its clean-up) are not counted.

This module imports nothing of vLLM or torch: `tilert-pd wait-idle` loads it alone.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger(__name__)

#: Where the counts are kept unless kv_connector_extra_config's tilert_pending_dir says otherwise
#: (per container in a pod; prefills sharing a host in `tilert-pd local` share it, so one's wait-idle
#: then also waits for the other's sends: longer, never shorter).
DEFAULT_DIR = "/tmp/tilert-pd-prefill"
_PREFIX = "sends-"


class UnsafeDirectory(OSError):
    """The directory is not this user's alone: a count read from (or written to) it cannot be trusted."""


def private_dir(path: str | os.PathLike[str], create: bool) -> Path:
    """`path`, created 0700 when `create` and it is missing; UnsafeDirectory when it is not a
    directory of this user's that no one else may write."""
    p = Path(path)
    if create:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{p} is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{p} belongs to uid {st.st_uid}, not to this process's uid {os.getuid()}")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(f"{p} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it")
    return p


class PendingSends:
    """This process's count of handoffs queued or in flight, mirrored to its file on every change.
    The sender threads and the step thread change it; `close` removes the file."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.path: Path | None = None
        try:
            self.path = private_dir(directory, create=True) / f"{_PREFIX}{os.getpid()}"
            self._write()
        except OSError as exc:
            # The handoffs still work; only a graceful scale-down cannot see them.
            log.error(
                "TileRTConnector: cannot keep the pending handoff count in %s (%s); "
                "tilert-pd wait-idle will not wait for this worker's sends",
                directory,
                exc,
            )
            self.path = None

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.count}\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        with self._lock:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
                self.path = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, but not ours to count
        return True
    return True


def read(directory: str | os.PathLike[str]) -> dict[int, int]:
    """The pending count of every live worker process that keeps one in `directory` ({} when there
    is none: no prefill with the connector ran here). UnsafeDirectory as `private_dir`."""
    try:
        p = private_dir(directory, create=False)
    except FileNotFoundError:
        return {}
    counts: dict[int, int] = {}
    for f in p.iterdir():
        if not f.name.startswith(_PREFIX) or not f.name[len(_PREFIX) :].isdigit():
            continue
        pid = int(f.name[len(_PREFIX) :])
        if not _alive(pid):
            continue
        try:
            counts[pid] = max(0, int(f.read_text().strip() or 0))
        except (OSError, ValueError):
            continue  # replaced or removed while read: the next poll sees it
    return counts
