"""A target process for transfer tests: registers a zeroed buffer, prints its peer info as one JSON
line (prefixed PEER; libraries may log to stdout), then answers commands on stdin: `md5 OFFSET LEN`, `zeros OFFSET LEN`, `quit`; answers are prefixed R."""

import hashlib
import json
import os
import sys

import numpy as np

from tilert_serve import transfer


def main() -> None:
    engine_name, nbytes = sys.argv[1], int(sys.argv[2])
    engine = transfer.create(engine_name, host="127.0.0.1", protocol="tcp", role="target")
    buf = np.zeros(nbytes, dtype=np.uint8)
    addr = buf.ctypes.data
    engine.register(addr, nbytes)
    print("PEER " + json.dumps({"peer": engine.peer_info(), "addr": addr, "nbytes": nbytes}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            break
        off, n = int(args[0]), int(args[1])
        view = buf[off : off + n]
        if cmd == "md5":
            print("R", hashlib.md5(view.tobytes()).hexdigest(), flush=True)
        elif cmd == "zeros":
            print("R", "yes" if not view.any() else "no", flush=True)
    sys.stdout.flush()
    # NIXL/UCX teardown can crash at interpreter exit (UCX's ib modules beside the system's libefa).
    os._exit(0)


if __name__ == "__main__":
    main()
