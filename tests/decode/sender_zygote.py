"""Starts sender_proc.py's runs without paying its imports each time: this process imports what
sender_proc imports (torch, the transfer engines' modules, the handoff code) once, creates no engine and
no thread that a child would need, and forks one child per run. Each child is a sender process of its
own, as `python sender_proc.py ARGS` would be (its own Mooncake or NIXL engine, its own exit; a child
that SIGKILLs itself kills only itself), with its stdout in a file the caller names.

Protocol (lines on stdin/stdout): `{"id": ID, "args": [...], "out": PATH}` -> `PID ID PID`, later
`EXIT ID RC` (RC as subprocess reports it: -9 for SIGKILL). EOF on stdin ends the zygote."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.dirname(__file__))
import sender_proc

_lock = threading.Lock()


def _reply(line: str) -> None:
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _wait(rid: str, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    _reply(f"EXIT {rid} {os.waitstatus_to_exitcode(status)}")


def _child(args: list[str], out: str) -> None:
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stdin = open(0, closefd=False)
        sys.argv = [sender_proc.__file__, *args]
        sender_proc.main()  # ends with os._exit(0) or a SIGKILL of its own
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req["args"], req["out"])
        _reply(f"PID {req['id']} {pid}")
        threading.Thread(target=_wait, args=(str(req["id"]), pid), daemon=True).start()


if __name__ == "__main__":
    main()
