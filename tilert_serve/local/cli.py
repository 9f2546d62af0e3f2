"""`tilert-pd local up|apply|status|down`: run a PDCluster's components as local processes on loopback.

`up` generates the tiny model on first use, starts every component from the same rendered commands
the operator puts in pods, shows progress while engines load, fails with the component's log tail
if one does not come up (stopping the others), and returns once all are ready, leaving them running
in the background. `apply` converges the running stack to a changed PDCluster as Kubernetes'
controllers would (apply.py, rollout.py); `status` lists each component with its URL and health;
`down` stops them all.

`--runtime docker` runs the operator's rendered manifests instead, each pod a container of its image
(docker_runtime.py); `status` and `down` work for either runtime from what `up` recorded.

The home holds the stack's handoff secret, its node-API token and the PIDs `down` signals, so it must
be the caller's alone: `private_dir` creates it owner-only, and every action refuses a home (or a
cluster's state directory in it) owned by someone else or writable by group or others, before anything
is written, read back or signalled.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tilert_operator import constants
from tilert_operator.render.generations import DATA_PLANE, Live
from tilert_serve import defaults, observe, tinymodel
from tilert_serve.local import apply as applymod
from tilert_serve.local import docker, docker_apply, docker_runtime, rollout, runner
from tilert_serve.local import plan as planmod
from tilert_serve.router import config as router_config

if TYPE_CHECKING:
    from tilert_operator.spec import PDClusterSpec

#: The state file's key for the stack's Prometheus (`up --observe`).
PROMETHEUS = "prometheus"
DEFAULT_HOME = Path(os.environ.get("TILERT_PD_HOME", ".tilert-pd"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start a PDCluster's components locally and wait until they are ready")
    up.add_argument("-f", "--filename", required=True, help="PDCluster YAML (e.g. examples/tiny-cpu.yaml)")
    up.add_argument("--router-port", type=int, default=defaults.ROUTER_PORT)
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every component")
    up.add_argument(
        "--runtime",
        choices=("process", "docker"),
        default="process",
        help="process: each component a local process (default, no root needed); docker: each pod of "
        "the rendered manifests a container of its image (`make images` first)",
    )
    up.add_argument(
        "--observe",
        action="store_true",
        help="also start a local Prometheus (Debian's prometheus, on 127.0.0.1 with basic auth) scraping "
        "every component with the chart's recording and alerting rules (process runtime)",
    )
    ap = sub.add_parser(
        "apply",
        help="converge a running stack to a changed PDCluster as Kubernetes' controllers would (rolling "
        "updates, scaling, endpoints out before SIGTERM)",
    )
    ap.add_argument("-f", "--filename", required=True, help="the changed PDCluster YAML (same metadata.name)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a new pod may take to become ready (default %(default)s)",
    )
    st = sub.add_parser("status", help="list the local components with their URLs and health")
    st.add_argument("--json", action="store_true")
    sub.add_parser("down", help="stop every local component")
    for q in (up, st, *sub.choices.values()):
        if not any(a.dest == "home" for a in q._actions):
            q.add_argument(
                "--home", type=Path, default=DEFAULT_HOME, help="state directory (default %(default)s)"
            )


def private_dir(path: Path, *, create: bool = True) -> Path:
    """`path` as a directory only the caller can change: created owner-only (0700) when missing (with
    `create`), refused (ValueError saying how to fix it) when it is owned by another user or writable by
    group or others."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    problems = []
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        problems.append(f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        fix = f"`chmod go-w {path}`" + (
            "" if st.st_uid == os.geteuid() else f" after `sudo chown $(id -u) {path}`"
        )
        raise ValueError(
            f"the local state directory {path} is {' and '.join(problems)}: another user could swap the "
            f"handoff secret, the node-API token or the PIDs `down` signals in it. Run {fix}, or pass "
            "another --home"
        )
    return path


def run(args: argparse.Namespace) -> int:
    try:
        return {"up": up, "apply": apply, "status": status, "down": down}[args.action](args)
    except (
        applymod.Stalled,
        FileNotFoundError,
        ValueError,
        runner.StartFailed,
        docker_runtime.StartFailed,
        docker.DockerError,
    ) as exc:
        print(f"tilert-pd local {args.action}: {exc}", file=sys.stderr)
        return 1


def load_spec(filename: str) -> tuple[str, PDClusterSpec]:
    from tilert_operator import validation

    doc = _document(filename)
    if not isinstance(doc, dict) or doc.get("kind") != "PDCluster":
        raise ValueError(
            f"{filename} is not a PDCluster (kind: {doc.get('kind') if isinstance(doc, dict) else None})"
        )
    name = str(doc.get("metadata", {}).get("name") or "")
    spec, problems = validation.validate(doc.get("spec") or {}, name)
    if problems or spec is None:
        raise ValueError(f"{filename} is not a valid PDCluster:\n" + "\n".join(f"  - {p}" for p in problems))
    return name, spec


def _document(filename: str) -> dict[str, Any]:
    doc = yaml.safe_load(Path(filename).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{filename} is not a PDCluster (a YAML mapping with kind: PDCluster)")
    return doc


def model_dir_for(home: Path, name: str, spec: PDClusterSpec) -> Path:
    if spec.model.weights.tiny:
        return (home / "models" / f"{name}-tiny").resolve()
    volume = spec.model.weights.volume or {}
    host = (volume.get("hostPath") or {}).get("path")
    if not host:
        raise ValueError(
            "local runs read weights from spec.model.weights.tiny or a hostPath volume; this spec has neither"
        )
    return (Path(host) / spec.model.weights.sub_path).resolve()


def say(msg: str) -> None:
    print(msg, flush=True)


def up(args: argparse.Namespace) -> int:
    name, spec = load_spec(args.filename)
    home = private_dir(args.home)
    state_dir = (home / name).resolve()
    if state_dir.exists():
        private_dir(state_dir)
    if (state_dir / runner.STATE_FILE).exists() and _is_running(state_dir):
        raise ValueError(f"{name} is already running locally; `tilert-pd local down` first")
    if getattr(args, "runtime", "process") == "docker":
        if args.observe:
            raise ValueError(
                "--observe runs with the process runtime only; drop --runtime docker or --observe"
            )
        return _up_docker(args, name, spec, state_dir)
    stack = launch(
        name, spec, state_dir, file=args.filename, router_port=args.router_port, timeout=args.timeout
    )
    if getattr(args, "observe", False):
        _observe(stack)
    say(
        f"ready: the OpenAI API is at {stack.router}/v1 (model {spec.model.name!r}); "
        "`tilert-pd local status`, `tilert-pd local down`"
    )
    return 0


@dataclass
class LocalStack:
    """What `launch` started: the plan it ran (components, router config) and the processes."""

    name: str
    spec: PDClusterSpec
    state_dir: Path
    plan: planmod.Plan
    procs: list[runner.Running]
    router: str
    secret_file: Path
    token_file: Path


def launch(
    name: str,
    spec: PDClusterSpec,
    state_dir: Path,
    *,
    file: str,
    router_port: int,
    timeout: float = 600.0,
    say: Callable[[str], None] = say,
    adjust: Callable[[planmod.Plan], planmod.Plan] | None = None,
    warm_up: bool = True,
) -> LocalStack:
    """Start a PDCluster's components as local processes (what `up` runs) and wait until they serve.

    `adjust` may change the plan before anything starts (tests: a shorter handoff-probe interval in the
    router config, a component's own copy of a credential); the router reads the adjusted config."""
    if runner.port_in_use(router_port):
        raise ValueError(f"port {router_port} is taken; pass --router-port")
    private_dir(state_dir.parent)
    private_dir(state_dir)
    # 0600 from the moment they exist (runner.write_secret_file), fresh for every run.
    secret, token = runner.write_secrets(state_dir)
    model_dir = model_dir_for(state_dir.parent, name, spec)
    prefill_n, tilert_n, native_n = planmod.replica_counts(spec)
    ports = planmod.Ports(
        router=router_port,
        prefill=[runner.free_port() for _ in range(prefill_n)],
        native=[runner.free_port() for _ in range(native_n)],
        tilert=[(runner.free_port(), runner.free_port()) for _ in range(tilert_n)],
        router_replicas=[runner.free_port() for _ in range(spec.router.replicas)],
    )
    p = planmod.plan(
        spec,
        ports=ports,
        model_dir=str(model_dir),
        secret_file=str(secret),
        router_config_file=str(state_dir / "router.yaml"),
        api_token_file=str(token),
    )
    if adjust is not None:
        p = adjust(p)
    workloads = _workloads(name, spec)
    live = Live(spec)
    (state_dir / "router.yaml").write_text(router_config.dump(p.router_config))
    say(f"tilert-pd local: {name} from {file} (state in {state_dir})")
    if p.tiny_model is not None and not tinymodel.is_current(model_dir):
        say(f"  generating the tiny model into {model_dir} ...")
        subprocess.run(p.tiny_model, check=True, stdout=subprocess.DEVNULL)
    started: list[runner.Running] = []
    meta: dict[str, object] = {
        "cluster": name,
        "file": str(Path(file).resolve()),
        "started": time.time(),
        "router": f"http://127.0.0.1:{router_port}",
        rollout.GENERATIONS_KEY: {
            live.slot: asdict(rollout.RecordedGeneration.of(live, applymod.now_rfc3339()))
        },
    }
    try:
        engines = [c for c in p.components if c.kind != constants.ROUTER]
        for c in engines:
            say(f"  start  {c.name:<10} {c.url}")
            started.append(_as_pod(runner.start(runner.with_side_channel(c), state_dir), workloads, live))
        runner.save(state_dir, meta, started)
        runner.wait_ready(started, timeout, say)
        routers = [c for c in p.components if c.kind == constants.ROUTER]
        for router in routers:
            say(f"  start  {router.name:<10} {router.url}")
            started.append(_as_pod(runner.start(router, state_dir), workloads, live))
        runner.save(state_dir, meta, started)
        runner.wait_ready(started[-len(routers) :], 60, say)
        if warm_up:
            _warm_up(spec, meta["router"], say)
    except BaseException:
        say("  stopping what was started ...")
        runner.stop(started)
        (state_dir / runner.STATE_FILE).unlink(missing_ok=True)
        raise
    return LocalStack(name, spec, state_dir, p, started, str(meta["router"]), secret, token)


def _observe(stack: LocalStack) -> None:
    """Start a Prometheus scraping the stack's components (their /metrics are open on loopback in a local
    run) and record it in the state, so that `status` shows it and `down` stops it."""
    targets = [observe.local_target(c.kind, c.url) for c in stack.plan.components]
    try:
        handle = observe.start(stack.state_dir, targets)
    except (observe.ObserveError, observe.ConfigError) as exc:
        raise ValueError(f"the stack runs, but its Prometheus did not start: {exc}") from exc
    meta, procs = runner.load(stack.state_dir)
    meta[PROMETHEUS] = {
        "url": handle.url,
        "pid": handle.process.pid,
        "started": runner.start_time(handle.process.pid),
        "log": str(handle.log_file),
        "password_file": str(handle.password_file),
    }
    runner.save(stack.state_dir, meta, procs)
    say(
        f"  prometheus {handle.url} (user {handle.username}, password in {handle.password_file}); "
        "rules: tilert_pd:* recordings and TilertPD* alerts"
    )


def _prometheus(meta: dict[str, Any]) -> runner.Running | None:
    """The stack's Prometheus (`up --observe`) as a process `runner` can check and stop."""
    p = meta.get(PROMETHEUS)
    if not isinstance(p, dict):
        return None
    return runner.Running(
        "prometheus", "prometheus", int(p["pid"]), str(p["url"]), "", str(p["log"]), started=p.get("started")
    )


def _workloads(name: str, spec: PDClusterSpec) -> dict[str, rollout.Rendered]:
    """The operator's workloads for `spec`, by component (what `up` records each process as)."""
    return {r.component: r for r in _workloads_all(name, spec) if r.workload.name == f"{name}-{r.component}"}


def _as_pod(run: runner.Running, workloads: dict[str, rollout.Rendered], live: Live) -> runner.Running:
    r = workloads.get(run.kind)
    if r is None:  # a component the render does not have: `apply` will remove it
        return run
    ordinal = int(run.name.rsplit("-", 1)[1]) if run.name[-1].isdigit() else 0
    return applymod.record(run, r, ordinal, r.workload.revision, live)


def apply(args: argparse.Namespace) -> int:
    name, spec = load_spec(args.filename)
    home = private_dir(args.home, create=False)
    state_dir = (home / name).resolve()
    if not (state_dir / runner.STATE_FILE).exists():
        raise FileNotFoundError(
            f"no local stack named {name!r} runs from {home}; start it with `tilert-pd local up -f "
            f"{args.filename}` (apply changes a running stack)"
        )
    private_dir(state_dir, create=False)
    state = _raw_state(state_dir)
    if state.get("runtime") == "docker":
        return docker_apply.apply(_document(args.filename), name, state_dir, state, args.timeout, say)
    meta, procs = runner.load(state_dir)
    say(f"tilert-pd local apply: {name} from {args.filename} (state in {state_dir})")
    model_dir = model_dir_for(home, name, spec)
    token = state_dir / runner.NODE_API_TOKEN_FILE
    base = planmod.paths(
        model_dir=str(model_dir),
        secret_file=str(state_dir / runner.HANDOFF_SECRET_FILE),
        router_config_file=str(state_dir / "router.yaml"),
        api_token_file=str(token),
    )
    if spec.model.weights.tiny and not tinymodel.is_current(model_dir):
        say(f"  generating the tiny model into {model_dir} ...")
        subprocess.run(planmod.tiny_model_argv(spec, base), check=True, stdout=subprocess.DEVNULL)
    rt = applymod.Processes(
        spec,
        state_dir,
        meta,
        procs,
        base,
        router_port=int(str(meta["router"]).rsplit(":", 1)[1]),
        api_token_file=str(token),
    )
    adopt_generations(meta, procs)
    slots = rollout.occupied(rollout.recorded(meta), _pod_generations(procs))
    choice, phases = rollout.generation_phases(spec, slots)
    applymod.say_phases(choice.current, phases, say)

    def render_lives(lives: Sequence[Live]) -> list[rollout.Rendered]:
        return _workloads_all(name, spec, lives)

    steps = applymod.apply_generations(rt, phases, render_lives, args.timeout, say)
    meta["file"] = str(Path(args.filename).resolve())
    meta["applied"] = time.time()
    rt.save()
    say(f"applied: {steps} steps; the OpenAI API is at {meta['router']}/v1; `tilert-pd local status`")
    return 0


def _workloads_all(
    name: str, spec: PDClusterSpec, lives: Sequence[Live] | None = None
) -> list[rollout.Rendered]:
    """The operator's Deployments and StatefulSets for `spec` with the generations `lives` (None: `spec`
    alone in slot a); the Secrets, which no pod template depends on, left out."""
    from tilert_operator import render

    return rollout.rendered(render.children(spec, name, "default", lives=lives), name)


def _pod_generations(procs: Sequence[runner.Running]) -> dict[str, str | None]:
    """slot -> the fingerprint its data-plane pods recorded (None: from before generations)."""
    out: dict[str, str | None] = {}
    for p in procs:
        if p.kind in DATA_PLANE:
            out.setdefault(p.slot or constants.SLOT_A, p.generation or None)
    return out


def adopt_generations(meta: dict[str, object], procs: list[runner.Running]) -> None:
    """A state written before generations: one generation in slot a, the spec of the file it was last
    started or applied from (when that file still parses; else the pods are taken as the new spec's
    generation, as the operator takes workloads without a generation label)."""
    if rollout.GENERATIONS_KEY in meta:
        return
    try:
        _, spec = load_spec(str(meta.get("file") or ""))
    except (OSError, ValueError) as exc:
        say(
            f"  note: the state records no generation and its spec file does not load ({exc}); rolling in place"
        )
        return
    live = Live(spec)
    meta[rollout.GENERATIONS_KEY] = {
        live.slot: asdict(rollout.RecordedGeneration.of(live, applymod.now_rfc3339()))
    }
    for i, p in enumerate(procs):
        if p.kind in DATA_PLANE and not p.slot:
            procs[i] = replace(
                p, slot=live.slot, generation=live.generation.fingerprint, compat=live.generation.compat
            )


def _up_docker(args: argparse.Namespace, name: str, spec: PDClusterSpec, state_dir: Path) -> int:
    from tilert_operator.cli_render import render_document

    manifests = render_document(_document(args.filename), None, with_secret=True)
    private_dir(state_dir)
    # `apply` renders again with these same credentials (fresh ones would lock the new pods out).
    docker_apply.save_secrets(state_dir, manifests)
    say(f"tilert-pd local: {name} from {args.filename} as containers (state in {state_dir})")
    meta: dict[str, object] = {
        "cluster": name,
        "file": str(Path(args.filename).resolve()),
        "started": time.time(),
        "router": "",
        "runtime": "docker",
        "networks": [],
        "pods": [],
    }
    # Recorded before anything starts: an interrupted `up` leaves containers that `down` must find
    # (it removes everything carrying the run's label).
    runner.save_raw(state_dir, meta)
    try:
        records, networks = docker_runtime.up(manifests, name, state_dir, args.timeout, say)
    except BaseException:
        (state_dir / runner.STATE_FILE).unlink(missing_ok=True)  # up removed what it had started
        raise
    router = next((r.url for r in records if r.component == constants.ROUTER), "")
    records = docker_apply.with_revisions(records, rollout.rendered(manifests, name, local_names=False))
    meta |= {"router": router, "networks": networks, "pods": docker_runtime.dump(records)}
    runner.save_raw(state_dir, meta)
    try:
        _warm_up(spec, router, say)
    except BaseException:
        say("  removing what was started ...")
        docker_runtime.cleanup(name, state_dir)
        (state_dir / runner.STATE_FILE).unlink(missing_ok=True)
        raise
    say(
        f"ready: the OpenAI API is at {router}/v1 (model {spec.model.name!r}); pod logs: `docker logs "
        f"{docker_runtime.container_name(name, '<pod>', '<container>')}`; `tilert-pd local status`, "
        "`tilert-pd local down`"
    )
    return 0


def _raw_state(state_dir: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((state_dir / runner.STATE_FILE).read_text())
    return data


def _is_running(state_dir: Path) -> bool:
    state = _raw_state(state_dir)
    if state.get("runtime") == "docker":
        return bool(docker.unavailable() is None and docker.containers(str(state["cluster"])))
    _, old = runner.load(state_dir)
    return any(runner.running(p) for p in old)


def endpoints(state_dir: Path, component: str) -> tuple[str, list[str]]:
    """The router's URL and the URLs of one component's pods or processes, from what `up` recorded."""
    state = _raw_state(state_dir)
    if state.get("runtime") == "docker":
        return str(state["router"]), [
            r.url for r in docker_runtime.records_from(state) if r.component == component
        ]
    meta, procs = runner.load(state_dir)
    return str(meta["router"]), [p.url for p in procs if p.kind == component]


def _warm_up(spec: PDClusterSpec, router: object, say: Callable[[str], None]) -> None:
    """One short request down each decode path, so `up` returns a stack that serves both.

    The first native request makes vLLM's NIXL connector handshake with the prefill; on a loaded
    2-core machine that can outlast NIXL's 5 s handshake timeout once, hence a few attempts.
    """
    routes = [
        r for r, n in (("tilert", spec.decode.tilert.replicas), ("native", spec.decode.native.replicas)) if n
    ]
    for route in routes:
        body = json.dumps({"model": spec.model.name, "prompt": "warm up", "max_tokens": 2}).encode()
        error = ""
        for attempt in range(1, 4):
            t0 = time.monotonic()
            req = urllib.request.Request(
                f"{router}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", spec.router.policy.header: route},
            )
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                say(f"  warm   {route:<10} first request served in {time.monotonic() - t0:.1f} s")
                break
            except (urllib.error.URLError, OSError) as exc:
                error = str(exc)
                say(f"  warm   {route:<10} attempt {attempt} failed: {error}")
        else:
            raise ValueError(
                f"the {route} path does not serve ({error}); see the logs in the state directory"
            )


def _states(home: Path) -> list[Path]:
    """The state directories of the stacks recorded under `home` (each checked as private_dir)."""
    if not home.exists():
        return []
    private_dir(home, create=False)
    return sorted(private_dir(p.parent, create=False) for p in home.glob(f"*/{runner.STATE_FILE}"))


def status(args: argparse.Namespace) -> int:
    rows = []
    for state_dir in _states(args.home):
        state = _raw_state(state_dir)
        if state.get("runtime") == "docker":
            for rec in docker_runtime.records_from(state):
                ready = docker_runtime.ready(rec)
                rows.append(
                    {
                        "cluster": state["cluster"],
                        "name": rec.name,
                        "kind": rec.component,
                        "url": rec.url,
                        "running": ready is not None,
                        "ready": bool(ready),
                        "log": f"docker logs {rec.containers[0]}",
                        "runtime": "docker",
                    }
                )
            continue
        meta, procs = runner.load(state_dir)
        prom = _prometheus(meta)
        if prom is not None:
            running = runner.running(prom)
            rows.append(
                {
                    "cluster": meta["cluster"],
                    "name": prom.name,
                    "kind": prom.kind,
                    "url": prom.url,
                    "pid": prom.pid,
                    "running": running,
                    # Its API wants the password (in the state directory): running is what we can say.
                    "ready": running,
                    "log": prom.log,
                }
            )
        for p in procs:
            running = runner.running(p)
            rows.append(
                {
                    "cluster": meta["cluster"],
                    "name": p.name,
                    "kind": p.kind,
                    "url": p.url,
                    "pid": p.pid,
                    "running": running,
                    "ready": running and runner.probe(p.ready_url),
                    "log": p.log,
                    # A data-plane pod's compatibility generation and slot (both run during a
                    # generation change's rollout).
                    "generation": p.generation or None,
                    "slot": p.slot or None,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no local stack is running")
    else:
        for r in rows:
            health = "ready" if r["ready"] else ("starting" if r["running"] else "stopped")
            print(f"{r['cluster']:<12} {r['name']:<22} {health:<9} {r['url']:<28} {r['log']}")
    return 0


def down(args: argparse.Namespace) -> int:
    states = _states(args.home)
    if not states:
        print("no local stack is running")
        return 0
    for state_dir in states:
        state = _raw_state(state_dir)
        if state.get("runtime") == "docker":
            removed = docker_runtime.cleanup(str(state["cluster"]), state_dir)
            (state_dir / runner.STATE_FILE).unlink(missing_ok=True)
            print(
                f"stopped {state['cluster']} ({removed} containers removed; their logs are in {state_dir / 'logs'})"
            )
            continue
        meta, procs = runner.load(state_dir)
        prom = _prometheus(meta)
        others = runner.stop(procs + ([prom] if prom is not None else []))
        (state_dir / runner.STATE_FILE).unlink(missing_ok=True)
        print(f"stopped {meta['cluster']} ({len(procs)} processes)")
        for p in others:
            print(
                f"  left pid {p.pid} alone: it is no longer {p.name} (that process ended; the PID was reused)"
            )
    return 0
