"""A prefill-side sender in its own process (the tests' other end of the wire).

usage: sender_proc.py CASE NUM_TOKENS SEED ENGINE HOST PORT SECRET_FILE REQUEST_ID [TICKET] [--die-after-accept]
                      [--no-digest] [--layerwise] [--die-after-layers=K] [--give-up-after-layers=K]
                      [--hold-after-layers=K] [--stall-after-layers=K] [--chunks=T1,T2,...] [--compat=HEX]
Prints one line `RESULT {json}`.

--layerwise hands the sender a LayerSource that gives one layer at a time, as a prefill's forward
does; --die-after-layers kills the process (SIGKILL) once K layers were given, --give-up-after-layers
makes the source fail (the prefill gave up), --stall-after-layers makes it time out (the prefill
staged nothing more), --hold-after-layers prints `HELD` after K layers and
waits for a line on stdin before giving the rest. --chunks makes it a chunked prefill's source: the
prompt is computed in chunks ending at T1, T2, ... and at NUM_TOKENS; staging starts empty and each
chunk puts its tokens there (the page a chunk ends inside holds garbage until the next chunk
completes it), then gives every layer's chunk; the last chunk's batches complete the layers.
--compat names the sender's compatibility generation (default: the unnamed one of its layout).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import sys

import torch

from tilert_serve import transfer
from tilert_serve.handoff import auth, messages
from tilert_serve.handoff.framing import SyncChannel
from tilert_serve.handoff.sender import HandoffRequest, LayerSourceFailed, Sender, Staged
from tilert_serve.layouts import Placement, write_ranges

sys.path.insert(0, os.path.dirname(__file__))
import handshake
import synthetic


def die_after_accept(host: str, port: int, secret: bytes, req: HandoffRequest, fingerprint: str) -> None:
    chan = SyncChannel.connect(host, port, timeout=10)
    handshake.authenticate(chan, secret, "doomed")
    chan.send(
        messages.Request(
            request_id=req.request_id,
            ticket=req.ticket,
            num_tokens=req.num_tokens,
            last_prompt_token=req.last_prompt_token,
            layout_fingerprint=fingerprint,
            compat=synthetic.unnamed_compat(fingerprint),
        )
    )
    accept = chan.recv()
    print("ACCEPTED", type(accept).__name__, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _flag(name: str) -> int | None:
    for a in sys.argv:
        if a.startswith(f"--{name}="):
            return int(a.split("=", 1)[1])
    return None


class OneByOne:
    """A LayerSource giving the layers one at a time, with the failure modes the flags ask for."""

    def __init__(self, num_layers: int) -> None:
        self.left = list(range(num_layers))
        self.given = 0

    def next_layers(self, timeout: float) -> Staged | None:
        if self.given == _flag("die-after-layers"):
            print(f"ACCEPTED and dying after {self.given} layers", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.given == _flag("give-up-after-layers"):
            raise LayerSourceFailed("the prefill gave up (test)")
        if self.given == _flag("stall-after-layers"):
            raise TimeoutError(f"the prefill staged no further layer in {timeout:.1f} s (test)")
        if self.given == _flag("hold-after-layers"):
            print("HELD", flush=True)
            sys.stdin.readline()
        if not self.left:
            return None
        self.given += 1
        return Staged([self.left.pop(0)])


class ChunkByChunk:
    """A LayerSource of a chunked prefill: per chunk, its tokens land in `staging` from `full`, then
    each layer's chunk is given; the last chunk completes the layers."""

    def __init__(self, staging: Placement, full: torch.Tensor, buf: torch.Tensor, ends: list[int]) -> None:
        self.staging, self.full, self.buf = staging, full, buf
        layers = range(staging.layout.num_layers)
        self.batches: list[tuple[int, int, list[int]]] = []
        start = 0
        for end in ends:
            self.batches += [(start, end, [lid]) for lid in layers]
            start = end
        self.num_tokens = ends[-1]
        self.landed = 0

    def next_layers(self, timeout: float) -> Staged | None:
        if not self.batches:
            return None
        start, end, layers = self.batches.pop(0)
        if end > self.landed:  # the chunk's forward: its tokens now in staging
            layout = self.staging.layout
            ranges = write_ranges(self.staging, self.staging, list(range(layout.num_layers)), end, start)
            for r, plane in zip(
                ranges, itertools.cycle(layout.planes), strict=False
            ):  # layer by layer, plane by plane
                self.buf[r.src : r.src + r.nbytes] = self.full[r.src : r.src + r.nbytes]
                if end < self.num_tokens and end % plane.unit_tokens:  # a page the next chunk completes
                    self.buf[r.src + r.nbytes - plane.unit_bytes : r.src + r.nbytes] = 0x5A
            self.landed = end
        return Staged(layers, start, None if end == self.num_tokens else end)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    case, n, seed, engine_name, host, port, secret_file, request_id = args[:8]
    ticket = args[8] if len(args) > 8 else None
    layout = synthetic.layout_for(case)
    num_tokens = int(n)
    secret = auth.load_secret(secret_file)
    req = HandoffRequest(
        request_id=request_id,
        num_tokens=num_tokens,
        last_prompt_token=11,
        ticket=ticket,
        prompt_token_ids=list(range(num_tokens)),
    )
    if "--die-after-accept" in sys.argv:
        die_after_accept(host, int(port), secret, req, layout.fingerprint)
    staging = Placement(layout, max_tokens=num_tokens)
    buf = torch.zeros(staging.total_nbytes(), dtype=torch.uint8)
    synthetic.fill(staging, [buf], num_tokens, int(seed))
    chunks = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--chunks=")), None)
    full = buf.clone()
    if chunks is not None:
        buf.zero_()
    engine = transfer.create(engine_name, host="127.0.0.1", protocol="tcp", role="sender")
    engine.register(buf.data_ptr(), buf.numel())
    sender = Sender(
        name="test-sender",
        secret=secret,
        engine=engine,
        staging=staging,
        staging_buffers=[buf],
        timeout_s=20,
        send_digest="--no-digest" not in sys.argv,
        compat=next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--compat=")), None),
    )
    source: OneByOne | ChunkByChunk | None = (
        OneByOne(layout.num_layers) if "--layerwise" in sys.argv else None
    )
    if chunks is not None:
        source = ChunkByChunk(staging, full, buf, [*map(int, chunks.split(",")), num_tokens])
    result = sender.send(host, int(port), req, layers=source)
    print("RESULT " + json.dumps(dataclasses.asdict(result)), flush=True)
    os._exit(0)  # NIXL/UCX teardown can crash at exit (docs/reference/transfer-engines.md, "Exit-time crash")


if __name__ == "__main__":
    main()
