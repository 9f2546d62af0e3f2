"""`tilert-pd local apply` on the process runtime: the tiny stack (one prefill, one TileRT node) is
started as `up --observe` starts it (its Prometheus scraping every component), then changed under a steady stream of requests through the router:

1. the TileRT pool 1 -> 2 (a StatefulSet scale-up: tilert-1 created, waited for, then an endpoint);
2. the TileRT pool back to 1 (tilert-1, the highest ordinal, drained and removed);
3. a prefill that never becomes ready (a Deployment rolling update that stalls): apply fails naming
   it, the old prefill keeps serving, and the next apply of a good spec resumes from there;
4. MTP off (prefill and TileRT): a new compatibility generation (the handoff layout loses its MTP
   layer), so the operator's blue/green rollout: prefill-b-0 and tilert-b-0 come up in slot b beside
   the old pods, all four in the router's list each with its generation's compat, and only once the new
   node is HandoffReady do the old ones leave the list and stop.

After each: the processes, the router's config file and the endpoints the router itself reports, every
component ready; and no request of the stream failed. A rolling update that completes (the new pod
ready and an endpoint before the old one leaves) is the docker apply test's prefill rollout: the same
rollout plan, and one vLLM start less here.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.parse
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.local.load_stream import Load
from tilert_operator import constants
from tilert_operator.render.generations import generation
from tilert_operator.spec import parse
from tilert_serve.local import apply as applymod
from tilert_serve.local import cli, runner

pytestmark = [
    pytest.mark.slow,
    # Five applies, two of which start a vLLM (1-3 minutes each on a loaded 2-core box).
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process identity is read from /proc"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
NAME = "tiny"


def _doc(tilert: int, prefill_args: list[str] | None = None, *, mtp: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    if not mtp:  # a new generation, and a cheaper one on CPU (no drafter)
        doc["spec"]["prefill"]["mtp"] = {"enabled": False}
        doc["spec"]["decode"]["tilert"]["mtp"] = False
    doc["spec"]["decode"]["tilert"]["replicas"] = tilert
    doc["spec"]["decode"]["native"]["replicas"] = 0
    doc["spec"]["prefill"]["extraArgs"] += prefill_args or []
    # Short hooks: the default preStop sleep (5 s) and grace periods would only make the test longer.
    for pool in (doc["spec"]["prefill"], doc["spec"]["decode"]["tilert"]):
        pool["termination"] = {"preStopSleepSeconds": 1, "gracePeriodSeconds": 20}
    return doc


@pytest.fixture
def load_during() -> Iterator[Any]:
    started: list[tuple[Load, threading.Thread]] = []

    def begin(router: str) -> Load:
        load = Load(router)
        t = threading.Thread(target=load.run, daemon=True)
        t.start()
        started.append((load, t))
        return load

    yield begin
    for load, t in started:
        load.stop.set()
        t.join(timeout=150)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(home, spec dir) of a stack `up` started; stopped with `down` afterwards."""
    home = tmp_path_factory.mktemp("apply-home")
    specs = tmp_path_factory.mktemp("apply-specs")
    first = specs / "a.yaml"
    first.write_text(yaml.safe_dump(_doc(1)))
    port = runner.free_port()
    rc = cli.run(
        argparse.Namespace(
            action="up",
            filename=str(first),
            home=home,
            router_port=port,
            timeout=600.0,
            runtime="process",
            observe=True,
        )
    )
    assert rc == 0
    meta, _ = _state(home)
    prometheus = runner.Running("prometheus", "prometheus", 0, "", "", "")
    if isinstance(meta.get(cli.PROMETHEUS), dict):
        p = meta[cli.PROMETHEUS]
        prometheus = runner.Running(
            "prometheus", "prometheus", p["pid"], p["url"], "", "", started=p["started"]
        )
    yield home, specs
    cli.run(argparse.Namespace(action="down", home=home))
    # `up --observe` recorded its Prometheus, and `down` stopped it with the components.
    assert prometheus.pid and not runner.running(prometheus)


def _query(meta: dict[str, Any], promql: str) -> list[dict[str, Any]]:
    p = meta[cli.PROMETHEUS]
    auth = b64encode(f"tilert-pd:{Path(p['password_file']).read_text()}".encode()).decode()
    req = urllib.request.Request(
        f"{p['url']}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
        headers={"Authorization": f"Basic {auth}"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return list(json.loads(r.read())["data"]["result"])


def _check_observed(home: Path) -> None:
    """`up --observe`: a Prometheus on 127.0.0.1 behind basic auth scrapes each component the stack
    runs (that `down` stops it, the fixture checks)."""
    meta, _ = _state(home)
    assert str(meta[cli.PROMETHEUS]["url"]).startswith("http://127.0.0.1:")
    want = {"router", "prefill", "tilert-decode"}
    deadline = time.monotonic() + 120
    up: set[str] = set()
    while time.monotonic() < deadline and up != want:  # until each target's first scrape succeeded
        up = {s["metric"]["job"] for s in _query(meta, "up == 1")}
        time.sleep(0.5)
    assert up == want


def _apply(home: Path, specs: Path, doc: dict[str, Any], name: str, timeout: float = 600.0) -> int:
    path = specs / name
    path.write_text(yaml.safe_dump(doc))
    return cli.run(argparse.Namespace(action="apply", filename=str(path), home=home, timeout=timeout))


def _state(home: Path) -> tuple[dict[str, object], list[runner.Running]]:
    return runner.load(home / NAME)


def _check_converged(home: Path, names: set[str]) -> list[runner.Running]:
    """The recorded processes are exactly `names`, each running and ready; the router's config file
    and the router itself list exactly the non-router ones."""
    meta, procs = _state(home)
    assert {p.name for p in procs} == names
    for p in procs:
        assert runner.running(p) and runner.probe(p.ready_url), f"{p.name} is not ready"
    endpoints = {p.url for p in procs if p.kind != constants.ROUTER}
    cfg = yaml.safe_load((home / NAME / "router.yaml").read_text())
    urls = {e if isinstance(e, str) else e["url"] for e in [*cfg["prefill"], *cfg["native"]]}
    urls |= {n["http_url"] for n in cfg["tilert"]}
    assert urls == endpoints
    assert applymod.router_endpoints(str(meta["router"])) == endpoints
    return procs


def test_scale_roll_and_a_stalled_rollout_lose_no_request(
    stack: tuple[Path, Path], load_during: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    home, specs = stack
    _check_observed(home)
    meta, before = _state(home)
    load = load_during(str(meta["router"]))

    # 1. TileRT 1 -> 2: a new ordinal, nothing else touched.
    assert _apply(home, specs, _doc(2), "b.yaml") == 0
    procs = _check_converged(home, {"prefill-0", "tilert-0", "tilert-1", "router"})
    assert {p.pid for p in procs} >= {p.pid for p in before}, "a process that did not change was restarted"
    out = capsys.readouterr().out
    assert "tilert: 2/2 updated, waiting for tilert-1 ready" in out

    # 2. TileRT back to 1: tilert-1 goes, nothing else is touched.
    removed = next(p for p in procs if p.name == "tilert-1")
    assert _apply(home, specs, _doc(1), "c.yaml") == 0
    procs = _check_converged(home, {"prefill-0", "tilert-0", "router"})
    assert {p.pid for p in procs} <= {p.pid for p in before} and not runner.running(removed)
    assert "remove tilert-1 (scale down)" in capsys.readouterr().out

    # 3. A prefill that cannot start: apply fails, the serving one stays; a good spec resumes.
    assert _apply(home, specs, _doc(1, ["--no-such-vllm-flag"]), "d.yaml", timeout=300) == 1
    err = capsys.readouterr().err
    assert "prefill-1" in err and "keep serving" in err
    _, procs = _state(home)
    serving = next(p for p in procs if p.name == "prefill-0")
    assert runner.running(serving) and runner.probe(serving.ready_url)
    assert applymod.router_endpoints(str(meta["router"])) == {
        p.url for p in procs if p.name in ("prefill-0", "tilert-0")
    }
    assert _apply(home, specs, _doc(1), "e.yaml") == 0
    _check_converged(home, {"prefill-0", "tilert-0", "router"})
    assert "remove prefill-1 (not running)" in capsys.readouterr().out

    # 4. A new compatibility generation: blue/green through slot b.
    old_fp, new_fp = (generation(parse(_doc(1, mtp=mtp)["spec"])) for mtp in (True, False))
    assert old_fp.fingerprint != new_fp.fingerprint
    t0 = time.monotonic()
    assert _apply(home, specs, _doc(1, mtp=False), "f.yaml") == 0
    took = time.monotonic() - t0
    procs = _check_converged(home, {"prefill-b-0", "tilert-b-0", "router"})
    out = capsys.readouterr().out
    # Side by side: the new pods joined the old ones in the router's list (four endpoints), the new
    # generation was ready and HandoffReady, and only then did the old pods leave and stop.
    side_by_side = out.index("router has the new endpoints (4 endpoints")
    assert out.index("generation phase 1/2") < side_by_side < out.index("ready and HandoffReady")
    assert out.index("ready and HandoffReady") < out.index("remove prefill-0") < out.index("remove tilert-0")
    for p in procs:
        if p.kind != constants.ROUTER:
            assert (p.slot, p.generation, p.compat) == ("b", new_fp.fingerprint, new_fp.compat), p
    cfg = yaml.safe_load((home / NAME / "router.yaml").read_text())
    assert {e["compat"] for e in cfg["prefill"]} | {n["compat"] for n in cfg["tilert"]} == {new_fp.compat}
    meta, _ = _state(home)
    assert set(meta["generations"]) == {"b"}  # type: ignore[arg-type]
    with capsys.disabled():
        print(f"\ngeneration change (MTP off) applied blue/green in {took:.0f} s")

    load.stop.set()
    with capsys.disabled():
        print(f"\nrequest stream through five applies: {load.ok} ok, {len(load.failures)} failed")
    assert load.ok > 0
    assert load.failures == [], f"{len(load.failures)} of {load.ok + len(load.failures)} requests failed"
