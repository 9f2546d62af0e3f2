"""`tilert-pd local apply`: converge a running local stack to a new render, as Kubernetes' controllers
would. The steps come from rollout.py (pure); this module runs them against a runtime, one at a time:

- **Create** starts a pod of the new revision (not yet an endpoint);
- **Wait** waits until the pods pass their readiness check, then makes them endpoints: the router's
  config is rewritten and `apply` waits until the router has loaded it (read back from its metrics,
  which list every endpoint of its current config), as the endpoints controller adds a ready pod;
- **Remove** first takes the pod out of the endpoints the same way, so no new request reaches it, then
  stops it as the kubelet does: the preStop hook, SIGTERM, up to terminationGracePeriodSeconds for it
  to finish what it serves, then SIGKILL.

A change of compatibility generation (tilert_operator.render.generations: the model, the handoff
layout, the protocol) plays the operator's blue/green rollout instead (`apply_generations`): the new
generation's pods come up in the other slot beside the old ones, both in the router's endpoint list
each with its own generation's `compat` (the router pairs only within one); once the new pools are
ready and their TileRT nodes HandoffReady (read as the operator reads it, from each node's
authenticated /v1/status), the old generation leaves the endpoints and is drained. The operator's own
functions decide (tilert_operator.rollout `choose`, `lives`, `readiness`), fed from the state.

The state file is written after every step, so `status` and `down` see what runs, and an `apply`
that stopped (a pod never became ready: `Stalled`, the old pods still serving as a stalled rollout
leaves them) plans again from there when run again.

`Processes` is the process runtime's side; the docker runtime's is in docker_apply.py.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tilert_operator import constants, observe, status
from tilert_operator import handoff as handoff_check
from tilert_operator import rollout as op_rollout
from tilert_operator.render import commands
from tilert_operator.render.generations import Live
from tilert_operator.spec import PDClusterSpec
from tilert_serve.local import plan as planmod
from tilert_serve.local import rollout, runner
from tilert_serve.router import config as router_config
from tilert_serve.router.metrics import ENDPOINT_HEALTHY, NATIVE_PAIRS

#: The router's gauge that has one series per endpoint of its current config (state.apply keeps
#: exactly those): reading its label set back says which config the router runs.
#: How long the router may take to load a rewritten config (it polls the file every couple of seconds).
ROUTER_RELOAD_TIMEOUT_S = 60.0
#: How long a rollout waits for the router to warm new (prefill, native) pairs before it goes on.
WARM_TIMEOUT_S = 120.0
#: The pods whose first requests the router's warm-ups make (router/native_pairs.py): they stay at
#: idle CPU priority until warmed, as their first forward would run on a cluster pod's own CPUs
#: (on the 2-core box it took up to 30 s of the CPUs the serving pods share).
WARMED = frozenset({constants.PREFILL, constants.NATIVE})


class Stalled(RuntimeError):
    """A new pod did not become ready (or the router did not take a config): the rollout stops here."""


class Runtime(Protocol):
    def pods(self) -> list[rollout.Pod]: ...

    def create(self, step: rollout.Create, rendered: rollout.Rendered) -> None: ...

    def wait(self, pods: Sequence[str], timeout: float, say: Callable[[str], None]) -> None: ...

    def publish(self, serving: set[str], say: Callable[[str], None]) -> None:
        """Make exactly `serving` the endpoints (routers and decode pools) and wait until the router
        has them; pods of other components in it are ignored."""

    def stop(self, pod: str, say: Callable[[str], None]) -> None: ...

    def save(self) -> None: ...


class GenerationRuntime(Runtime, Protocol):
    def use(self, lives: Sequence[Live]) -> None:
        """Render `lives` from now on: new pods of a slot are its generation's, and the state records
        exactly these generations."""

    def readiness(self, live: Live, rendered: Sequence[rollout.Rendered]) -> tuple[op_rollout.Readiness, str]:
        """Whether `live` can take over (its pools ready, its TileRT nodes HandoffReady), and what its
        nodes report, for progress."""


#: How often a new generation's readiness is read again while apply waits for it.
READINESS_POLL_S = 1.0


def apply_generations(
    rt: GenerationRuntime,
    phases: Sequence[Sequence[Live]],
    render: Callable[[Sequence[Live]], Sequence[rollout.Rendered]],
    timeout: float,
    say: Callable[[str], None],
) -> int:
    """Converge through `phases` (rollout.generation_phases); between two, wait until the newest
    generation is ready to take over (Stalled after `timeout` s, the old generation still serving, so
    that the next apply resumes). The number of steps."""
    steps = 0
    for i, lives in enumerate(phases):
        rt.use(lives)
        if len(phases) > 1:
            names = " + ".join(f"{g.generation.fingerprint} (slot {g.slot})" for g in lives)
            what = "beside the old one" if i == 0 else "alone; the old one leaves the endpoints, then drains"
            say(f"  generation phase {i + 1}/{len(phases)}: {names}: the new generation {what}")
        rendered = render(lives)
        # Until the new generation takes over, the old one serves as it runs: a rollout of its own
        # that stalled before (its recorded spec is the last applied) must not hold the new one back.
        old = {g.slot for g in lives[:-1]}
        keep = frozenset(r.workload.name for r in rendered if r.slot in old)
        steps += converge(rt, rendered, timeout, say, keep)
        if i < len(phases) - 1:
            await_generation(rt, lives[-1], rendered, timeout, say)
    return steps


def await_generation(
    rt: GenerationRuntime,
    live: Live,
    rendered: Sequence[rollout.Rendered],
    timeout: float,
    say: Callable[[str], None],
) -> None:
    """Wait until `live` is ready to take over, printing what it still waits for when that changes."""
    t0 = time.monotonic()
    said = ""
    while True:
        ready, detail = rt.readiness(live, rendered)
        elapsed = time.monotonic() - t0
        if ready.ready:
            say(
                f"  new generation {live.generation.fingerprint} ready and HandoffReady ({elapsed:.1f} s): {detail}"
            )
            return
        text = "; ".join(ready.waiting) + (f" ({detail})" if detail else "")
        if ready.stuck is not None or elapsed > timeout:
            raise Stalled(
                f"the new generation {live.generation.fingerprint} (slot {live.slot}) was not ready to take "
                f"over within {timeout:.0f} s: {text}. The old generation keeps serving beside it; fix what "
                "this names and `tilert-pd local apply` again (it resumes from here), or apply the old spec "
                "to remove the new generation."
            )
        if text != said:
            say(f"  waiting for the new generation {live.generation.fingerprint}: {text} ({elapsed:.0f} s)")
            said = text
        time.sleep(READINESS_POLL_S)


def converge(
    rt: Runtime,
    rendered: Sequence[rollout.Rendered],
    timeout: float,
    say: Callable[[str], None],
    keep: frozenset[str] = frozenset(),
) -> int:
    """Run every step from what runs to `rendered`; the number of steps. Stalled when a new pod is
    not ready within `timeout` seconds (what ran before it keeps serving). The pods of the workloads
    in `keep` are left as they run (an old generation serving while the new one comes up)."""
    by_name = {r.workload.name: r for r in rendered}
    pods = rt.pods()
    steps = [s for s in rollout.plan([r.workload for r in rendered], pods) if s.workload not in keep]
    if not steps:
        say("  nothing to change: every pod runs its workload's current template and count")
        return 0
    creates = sum(isinstance(s, rollout.Create) for s in steps)
    removes = sum(isinstance(s, rollout.Remove) for s in steps)
    say(f"  {len(steps)} steps: {creates} pods to create, {removes} to remove")
    # A pod whose workload is no longer rendered (an old generation's) leaves the endpoints at once, as
    # the endpoints controller drops a deleted workload's terminating pods; it is stopped after
    # everything rendered has converged.
    serving = {p.name for p in pods if p.running and p.ready and p.workload in by_name}
    rt.publish(serving, say)
    for step in steps:
        if isinstance(step, rollout.Create):
            say(f"  create {step.pod} ({step.workload}, template {step.revision})")
            rt.create(step, by_name[step.workload])
        elif isinstance(step, rollout.Wait):
            say(f"  {step.progress}")
            rt.wait(step.pods, timeout, say)
            serving |= set(step.pods)
            rt.publish(serving, say)
        else:
            say(f"  remove {step.pod} ({step.why}): out of the endpoints first, then stopped")
            serving.discard(step.pod)
            rt.publish(serving, say)
            rt.stop(step.pod, say)
        rt.save()
    return len(steps)


def _router_metrics(router: str, timeout: float) -> list[Metric] | None:
    """The metric families the router at `router` exposes; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{router}/metrics", timeout=timeout) as r:
            return list(text_string_to_metric_families(r.read().decode()))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def router_endpoints(router: str, timeout: float = 5.0, pool: str | None = None) -> set[str] | None:
    """The endpoint URLs (of `pool`, else all) of the config the router at `router` runs now; None
    when it does not answer."""
    families = _router_metrics(router, timeout)
    if families is None:
        return None
    out: set[str] = set()
    for family in families:
        if family.name == ENDPOINT_HEALTHY:
            out |= {s.labels["endpoint"] for s in family.samples if pool is None or s.labels["pool"] == pool}
    return out


def await_router(router: str, expected: set[str], what: str, say: Callable[[str], None]) -> None:
    """Wait until the router's config has exactly `expected` endpoints (Stalled after
    ROUTER_RELOAD_TIMEOUT_S)."""
    t0 = time.monotonic()
    seen: set[str] | None = None
    while time.monotonic() - t0 < ROUTER_RELOAD_TIMEOUT_S:
        seen = router_endpoints(router)
        if seen == expected:
            say(f"    router has the new endpoints ({what}; {time.monotonic() - t0:.1f} s)")
            return
        time.sleep(0.2)
    raise Stalled(
        f"the router at {router} did not load its new config within {ROUTER_RELOAD_TIMEOUT_S:.0f} s "
        f"(it lists {sorted(seen) if seen is not None else 'nothing: it does not answer'}, expected "
        f"{sorted(expected)}); see its log in the state directory. Nothing was stopped."
    )


def native_pairs(router: str, timeout: float = 5.0) -> dict[str, int] | None:
    """The router's (prefill, native) pairs by state (router/native_pairs.py); None when it does not
    answer or does not report them."""
    for family in _router_metrics(router, timeout) or []:
        if family.name == NATIVE_PAIRS:
            return {s.labels["state"]: int(s.value) for s in family.samples}
    return None


def await_warm(router: str, say: Callable[[str], None]) -> None:
    """Wait (at most WARM_TIMEOUT_S) until the router has warmed every (prefill, native) pair of the
    endpoints it has: a rollout goes on to remove an old pod only once the new one has met its peers,
    or the pods that are left would pay the connector's first contact on users' requests (as
    Kubernetes' minReadySeconds holds a rollout). Not a stall when it does not come: warm-ups are
    retried, and the rollout must not hang on them."""
    t0 = time.monotonic()
    pairs = native_pairs(router)
    while pairs and (pairs.get("cold", 0) or pairs.get("warming", 0)):
        if time.monotonic() - t0 > WARM_TIMEOUT_S:
            say(f"    router still warming native pairs after {WARM_TIMEOUT_S:.0f} s ({pairs}); going on")
            return
        time.sleep(0.2)
        pairs = native_pairs(router)
    if pairs and time.monotonic() - t0 > 0.5:
        say(
            f"    router warmed its native pairs ({pairs.get('warm', 0)} warm; {time.monotonic() - t0:.1f} s)"
        )


def record(
    run: runner.Running, r: rollout.Rendered, ordinal: int, revision: str, live: Live | None = None
) -> runner.Running:
    """A started process as a pod of workload `r` (of generation `live`, for a data-plane pod)."""
    return replace(
        run,
        workload=r.workload.name,
        revision=revision,
        ordinal=ordinal,
        grace_s=r.grace_s,
        pre_stop=planmod.local_hook(r.pre_stop, run.url) if r.pre_stop else None,
        slot=r.slot,
        generation=live.generation.fingerprint if live is not None and r.slot else "",
        compat=live.generation.compat if live is not None and r.slot else None,
    )


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Processes:
    """The process runtime: each pod a local process (runner.py), the router's endpoints its config
    file (router.yaml in the state directory, which the router reloads when it changes)."""

    spec: PDClusterSpec
    state_dir: Path
    meta: dict[str, object]
    procs: list[runner.Running]
    paths: commands.Paths
    router_port: int
    api_token_file: str | None
    #: The generations rendered now, by slot (`use`).
    lives: dict[str, Live] = field(default_factory=dict)

    @property
    def router(self) -> str:
        return str(self.meta["router"])

    def _proc(self, name: str) -> runner.Running:
        return next(p for p in self.procs if p.name == name)

    def pods(self) -> list[rollout.Pod]:
        out = []
        for p in self.procs:
            if not p.revision:
                raise ValueError(
                    f"{self.state_dir / runner.STATE_FILE} was written by a tilert-pd from before "
                    "`apply` (it does not say which template each process runs); `tilert-pd local down` "
                    "and `up` again"
                )
            running = runner.running(p)
            # A few tries: on a loaded host one slow answer says nothing, and a pod taken for not
            # ready leaves the endpoints until a step makes it ready again.
            ready = running and any(runner.probe(p.ready_url) for _ in range(3))
            out.append(rollout.Pod(p.name, p.workload, p.revision, p.ordinal, running, ready))
        return out

    def use(self, lives: Sequence[Live]) -> None:
        before = rollout.recorded(self.meta)
        self.lives = {g.slot: g for g in lives}

        def created(g: Live) -> str:
            # A generation keeps the time it was first rendered (which of two came up last decides
            # which one makes room when a third arrives: tilert_operator.rollout.choose).
            old = before.get(g.slot)
            if old is not None and old.created and old.fingerprint == g.generation.fingerprint:
                return old.created
            return now_rfc3339()

        self.meta[rollout.GENERATIONS_KEY] = {
            g.slot: asdict(rollout.RecordedGeneration.of(g, created(g))) for g in lives
        }
        self.save()

    def _live(self, rendered: rollout.Rendered) -> Live | None:
        if not rendered.slot:
            return None
        live = self.lives.get(rendered.slot)
        if live is None:
            raise ValueError(f"{rendered.workload.name}: no generation is rendered in slot {rendered.slot}")
        return live

    def readiness(self, live: Live, rendered: Sequence[rollout.Rendered]) -> tuple[op_rollout.Readiness, str]:
        pools = rollout.pool_states(rendered, self.pods(), live.slot)
        nodes = [
            tilert_node(live.spec, p)
            for p in self.procs
            if p.kind == constants.TILERT and (p.slot or constants.SLOT_A) == live.slot
        ]
        token = Path(self.api_token_file).read_bytes() if self.api_token_file else b""
        secret = {"data": {constants.NODE_API_TOKEN_KEY: base64.b64encode(token).decode()}}
        return generation_readiness(pools, nodes, secret)

    def create(self, step: rollout.Create, rendered: rollout.Rendered) -> None:
        kind = rendered.component
        live = self._live(rendered)
        port = self.router_port if kind == constants.ROUTER else runner.free_port()
        ctrl = runner.free_port() if kind == constants.TILERT else None
        # A router replica shares the stack's port with the others and is probed on its own.
        own = runner.free_port() if kind == constants.ROUTER else None
        spec = live.spec if live else self.spec
        c = planmod.component(spec, self.paths, kind, step.pod, port, ctrl, replica_port=own)
        log = self.state_dir / f"{step.pod}.log"
        if log.exists():  # a StatefulSet pod created again under its name: keep the old one's log
            log.replace(log.with_suffix(".previous.log"))
        run = runner.start(runner.with_side_channel(c), self.state_dir, boot_idle=True)
        self.procs.append(record(run, rendered, step.ordinal, step.revision, live))

    def wait(self, pods: Sequence[str], timeout: float, say: Callable[[str], None]) -> None:
        procs = [self._proc(n) for n in pods]
        try:
            runner.wait_ready(procs, timeout, say)
        except runner.StartFailed as exc:
            raise Stalled(
                f"{exc}\nThe rollout stops here: the pods that served before it keep serving (as a "
                "stalled Kubernetes rollout leaves them). Fix the spec and `tilert-pd local apply` again, "
                "or `tilert-pd local down`."
            ) from exc
        for p in procs:  # ready: it serves now, at the normal CPU policy (a vLLM once warmed: publish)
            if p.kind not in WARMED:
                runner.promote(p)

    def publish(self, serving: set[str], say: Callable[[str], None]) -> None:
        pods = [p for p in self.procs if p.name in serving and p.kind != constants.ROUTER]
        cfg = endpoints_config(
            self.spec, pods, self.api_token_file, {slot: g.spec for slot, g in self.lives.items()}
        )
        path = self.state_dir / "router.yaml"
        text = router_config.dump(cfg)
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)  # one rename: the router never reads half a file
        routers = [p for p in self.procs if p.kind == constants.ROUTER and runner.running(p)]
        if not routers:
            say("    (no router running: its next start reads the new config)")
            return
        for r in routers:  # each replica, on its own port: every one must run the new config
            await_router(
                r.ready_url.removesuffix("/ready"), {p.url for p in pods}, f"{len(pods)} endpoints", say
            )
        for r in routers:  # and every one must have met the new pods
            await_warm(r.ready_url.removesuffix("/ready"), say)
        for p in pods:  # the warm-ups were the new vLLMs' own work, on "CPUs of their own" (idle)
            if p.kind in WARMED:
                runner.promote(p)

    def stop(self, pod: str, say: Callable[[str], None]) -> None:
        p = self._proc(pod)
        t0 = time.monotonic()
        if p.pre_stop and runner.running(p):
            # The kubelet runs the hook in the container; here the container is this host.
            try:
                subprocess.run(p.pre_stop, timeout=p.grace_s, check=False, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as exc:
                say(f"    {pod}: preStop {' '.join(p.pre_stop)} failed ({exc}); stopping it anyway")
        # As the kubelet: the grace period counts from the deletion, preStop included, and a hook that
        # used it all leaves SIGTERM two seconds more.
        left = max(2.0, p.grace_s - (time.monotonic() - t0))
        t1 = time.monotonic()
        runner.stop([p], grace_s=left)
        say(f"    {pod} stopped ({time.monotonic() - t0:.1f} s, {time.monotonic() - t1:.1f} s after SIGTERM)")
        self.procs.remove(p)

    def save(self) -> None:
        runner.save(self.state_dir, self.meta, self.procs)


def generation_readiness(
    pools: dict[str, observe.PoolState],
    nodes: Sequence[router_config.TileRTNode],
    secret: dict[str, Any],
) -> tuple[op_rollout.Readiness, str]:
    """Whether a generation can take over, as the operator decides it: its pools (rollout.pool_states)
    and its TileRT `nodes`' handoff verdicts, read from each node's /v1/status with the node-API token
    in `secret` (a Secret's data); and what the nodes report, for progress. Both runtimes call this."""
    reports = asyncio.run(handoff_check.poll(nodes, secret))
    verdicts = [(r.pod, *status.node_handoff(r)) for r in reports]
    detail = "; ".join(f"{pod}: {reason}" for pod, reason, _ in verdicts)
    return op_rollout.readiness(pools, [(pod, reason) for pod, reason, _ in verdicts]), detail


def tilert_node(spec: PDClusterSpec, p: runner.Running) -> router_config.TileRTNode:
    """The router's entry for a running TileRT pod of `spec`'s generation, with the pod's compat."""
    if p.ctrl_port is None:
        raise ValueError(f"{p.name}: no control port recorded; `tilert-pd local down` and `up` again")
    c = planmod.Component(p.name, p.kind, [], {}, p.url, p.ready_url, ctrl_port=p.ctrl_port)
    return planmod.node(spec, c).model_copy(update={"compat": p.compat})


def endpoints_config(
    spec: PDClusterSpec,
    pods: Iterable[runner.Running],
    api_token_file: str | None,
    specs: dict[str, PDClusterSpec] | None = None,
) -> router_config.RouterConfig:
    """The router config of a local run whose endpoints are `pods`, each listed with its own
    generation's compat (`specs`: slot -> the generation's spec, for a TileRT node's slots and
    sequence length; `spec`, the current one, for the rest and the router's own settings)."""
    pods = list(pods)
    specs = specs or {}

    def endpoint(p: runner.Running) -> router_config.Endpoint:
        return router_config.Endpoint(url=p.url, compat=p.compat)

    nodes = [
        tilert_node(specs.get(p.slot or constants.SLOT_A, spec), p)
        for p in pods
        if p.kind == constants.TILERT
    ]
    return planmod.router_settings(
        spec,
        prefill_urls=[endpoint(p) for p in pods if p.kind == constants.PREFILL],
        tilert_nodes=nodes,
        native_urls=[endpoint(p) for p in pods if p.kind == constants.NATIVE],
        api_token_file=api_token_file,
    )


def say_phases(current: str, phases: Sequence[Sequence[Live]], say: Callable[[str], None]) -> None:
    """Announce a blue/green rollout (more than one phase); both runtimes' `apply` say the same."""
    if len(phases) > 1:
        old = phases[0][0]
        say(
            f"  a new compatibility generation: {old.generation.fingerprint} (slot {old.slot}) -> "
            f"{phases[-1][-1].generation.fingerprint} (slot {current}); blue/green, as the operator "
            "rolls it: the new one beside the old, then the old one drained"
        )
