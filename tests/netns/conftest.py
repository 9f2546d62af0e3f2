"""A PD cluster on an emulated pod network plus a Multus-style secondary ("rdma") network, built from
network namespaces (tests/netns/bed.py), with the components started from the operator's rendered
commands and environment as `tilert-pd local` starts them.

Pods: `prefill` (eth0 + net1), `node0` (eth0 + net1), `router` (eth0 only, as in the cluster: the
router is not on the RDMA network). The decode node reads its Multus network-status from a file with
exactly what the downward API mounts for the pod annotation. The prefill pod runs
tests/netns/prefill_standin.py: the project's own Sender with a real Mooncake or NIXL engine bound
to its net1 address, answering the router as vLLM with TileRTConnector does.

Addresses come from ranges the machine does not use (10.250/10.251, fd00:250::/64, fd00:251::/64);
only the namespaces' own addresses and loopback are ever targets.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.netns import bed
from tilert_operator import validation
from tilert_operator.render import commands
from tilert_operator.render import router as router_render
from tilert_operator.spec import PDClusterSpec
from tilert_serve import dataplane, layouts
from tilert_serve.local import plan as local_plan
from tilert_serve.router import config as router_config

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
K8S_NAMESPACE = "tilert"
RDMA_NET = "rdma-net"
POD_NET = {4: ["10.250.0.0/24"], 6: ["10.250.0.0/24", "fd00:250::/64"]}
RDMA_SUBNET = {4: ["10.251.0.0/24"], 6: ["fd00:251::/64"]}
HTTP_PORT, CTRL_PORT, ROUTER_PORT, PREFILL_PORT = 5556, 5557, 8000, 8100
#: Tokens of the synthetic prompt: 6.9 MB of float32 MLA state for the tiny model, so a transfer
#: stands far above control traffic in the interface counters.
NUM_TOKENS = 1000
MAX_SEQ_LEN = 2048
#: Transfer settings inherited from the test runner's own environment (tests/decode sets UCX_NET_DEVICES=lo
#: process-wide) must not reach the pods: a pod gets only what the operator renders.
_POD_ENV_DROP = ("UCX_", "MC_", "NIXL_", "POD_", "VLLM_NIXL")


# -- session: availability and leftovers ----------------------------------------------------------


@pytest.fixture(scope="session")
def netns_available() -> Iterator[None]:
    reason = bed.unavailable_reason()
    if reason:
        pytest.skip(reason)
    stale = bed.crashed_leftovers()
    if stale:
        bed.delete_namespaces(stale)
    yield
    # Whatever a test of this session left (a fixture that never ran its finalizer).
    ours = [n for n in bed.namespaces() if n.startswith(f"{bed.PREFIX}{os.getpid()}-")]
    left = bed.delete_namespaces(ours)
    assert not left, f"namespaces that would not go: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert_serve.tinymodel.generate import TinySpec, generate

    out = tmp_path_factory.mktemp("netns-model") / "tiny"
    generate(TinySpec(), out)
    return out


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("netns-secret") / "secret"
    path.write_text(secrets.token_hex(32))
    return path


# -- the spec, its rendered commands, the pod files ------------------------------------------------


def spec_for(engine: str) -> PDClusterSpec:
    """examples/tiny-cpu.yaml with the handoff on `engine` over the Multus network RDMA_NET."""
    doc = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())
    s = doc["spec"]
    s["transfer"] = {**s["transfer"], "engine": engine, "rdma": {"networks": [RDMA_NET]}}
    s["decode"]["tilert"]["replicas"] = 1
    s["decode"]["native"]["replicas"] = 0
    spec, problems = validation.validate(s, doc["metadata"]["name"])
    assert spec is not None and not problems, problems
    return spec


def network_status(pod: bed.Pod, secondary: bool = True, default_name: str = "k8s-pod-network") -> str:
    """The `k8s.v1.cni.cncf.io/network-status` annotation as Multus writes it and a downwardAPI volume
    item mounts it: the annotation's value, a JSON list, nothing around it."""
    eth0 = pod.ifaces["eth0"]
    entries: list[dict[str, object]] = [
        {
            "name": default_name,
            "interface": "eth0",
            "ips": list(eth0.ips),
            "mac": eth0.mac,
            "default": True,
            "dns": {},
        }
    ]
    if secondary and "net1" in pod.ifaces:
        net1 = pod.ifaces["net1"]
        entries.append(
            {
                "name": f"{K8S_NAMESPACE}/{RDMA_NET}",
                "interface": "net1",
                "ips": list(net1.ips),
                "mac": net1.mac,
                "dns": {},
            }
        )
    return json.dumps(entries, indent=4)


def pod_env(pod: bed.Pod, family: int, extra: dict[str, str]) -> dict[str, str]:
    """What a container gets: the rendered env and the downward-API fields, over a clean base."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(_POD_ENV_DROP)}
    local = {
        k: v
        for k, v in local_plan.LOCAL_ENV.items()
        if k not in ("UCX_NET_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_HOST")
    }
    return {
        **base,
        **local,
        **local_plan.SINGLE_THREAD,
        "PYTHONPATH": f"{ROOT}:{local['PYTHONPATH']}",
        "POD_IP": pod.ip("eth0", family if family == 4 else 4),
        "POD_NAME": pod.name,
        "POD_NAMESPACE": K8S_NAMESPACE,
        "MC_LOG_LEVEL": "WARNING",
        **extra,
    }


def node_argv(spec: PDClusterSpec, model_dir: Path, secret: Path, status_file: Path) -> list[str]:
    paths = commands.Paths(
        model_dir=str(model_dir), secret_file=str(secret), http_port=HTTP_PORT, ctrl_port=CTRL_PORT
    )
    argv = local_plan._local_argv(commands.tilert_decode(spec, paths).argv)
    # Until the operator renders them, the flags the pod would get.
    if "--data-plane-networks" not in argv:
        argv += ["--data-plane-networks", ",".join(spec.transfer.rdma.networks)]
    if "--network-status-file" in argv:
        argv[argv.index("--network-status-file") + 1] = str(status_file)
    else:
        argv += ["--network-status-file", str(status_file)]
    return [*argv, "--name", "node0", "--log-level", "INFO"]


# -- the cluster -----------------------------------------------------------------------------------


@dataclass
class Cluster:
    engine: str
    family: int
    bed: bed.Bed
    spec: PDClusterSpec
    log_dir: Path
    model_dir: Path
    procs: dict[str, bed.PodProcess] = field(default_factory=dict)

    @property
    def node(self) -> bed.Pod:
        return self.bed.pods["node0"]

    @property
    def prefill(self) -> bed.Pod:
        return self.bed.pods["prefill"]

    @property
    def router(self) -> bed.Pod:
        return self.bed.pods["router"]

    def rdma_ip(self, pod: bed.Pod) -> str:
        return pod.ip("net1", self.family)

    def pod_ip(self, pod: bed.Pod) -> str:
        return pod.ip("eth0", 4)

    @property
    def state_bytes(self) -> int:
        return layouts.for_hf_config(
            "mla",
            json.loads((self.model_dir / "config.json").read_text()),
            self.spec.model.resolved_kv_cache_dtype,
        ).request_bytes(NUM_TOKENS)

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.tail()}" for name, p in self.procs.items())

    def node_url(self, path: str) -> str:
        return dataplane.http_url(self.pod_ip(self.node), HTTP_PORT) + path

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


def build_bed(tag: str, family: int) -> bed.Bed:
    b = bed.Bed(tag)
    try:
        b.network("pod", {"prefill": "eth0", "node0": "eth0", "router": "eth0"}, POD_NET[family])
        b.network("rdma", {"prefill": "net1", "node0": "net1"}, RDMA_SUBNET[family])
    except BaseException:
        b.close()
        raise
    return b


def start_node(
    c: Cluster, secret: Path, status_json: str, extra_args: tuple[str, ...] = ()
) -> bed.PodProcess:
    status_file = c.log_dir / "podinfo" / "network-status"
    status_file.parent.mkdir(parents=True, exist_ok=True)
    status_file.write_text(status_json)
    cmd = commands.tilert_decode(c.spec, commands.Paths(model_dir=str(c.model_dir)))
    env = pod_env(c.node, c.family, cmd.env)
    proc = bed.PodProcess(
        c.node, "node0", [*node_argv(c.spec, c.model_dir, secret, status_file), *extra_args], env, c.log_dir
    )
    c.procs["node0"] = proc
    return proc


def start_prefill(
    c: Cluster, secret: Path, kv_cache_dtype: str | None = None, num_tokens: int = NUM_TOKENS
) -> bed.PodProcess:
    """The stand-in as the prefill pod: its rendered env (spec.transfer.rdma.env) plus what the standin
    needs; UCX on the prefill side is pinned to net1 as an operator would pin it for a Multus interface.
    Told another KV-cache dtype than the spec's, it is a prefill of another layout."""
    cmd = commands.prefill(c.spec, commands.Paths(model_dir=str(c.model_dir)))
    env = pod_env(c.prefill, c.family, {**cmd.env, "UCX_NET_DEVICES": "net1"})
    argv = [
        sys.executable,
        str(HERE / "prefill_standin.py"),
        "--port",
        str(PREFILL_PORT),
        "--data-host",
        c.rdma_ip(c.prefill),
        "--transfer",
        c.engine,
        "--model-dir",
        str(c.model_dir),
        "--kv-cache-dtype",
        kv_cache_dtype or c.spec.model.resolved_kv_cache_dtype,
        "--served-model-name",
        c.spec.model.name,
        "--model-revision",
        c.spec.model.revision,
        "--secret-file",
        str(secret),
        "--num-tokens",
        str(num_tokens),
    ]
    proc = bed.PodProcess(c.prefill, "prefill", argv, env, c.log_dir)
    c.procs["prefill"] = proc
    return proc


def start_router(c: Cluster, ctrl_host: str, probes: dict[str, float] | None = None) -> bed.PodProcess:
    """The router as its pod runs it, with one TileRT node. Handoff probes off unless `probes` (changes
    to the rendered probe settings, e.g. a shorter interval): a test that counts the handoffs and the
    bytes of its own request wants none beside them."""
    cfg_file = c.log_dir / "router.yaml"
    node = router_config.TileRTNode(
        name="node0",
        http_url=c.node_url(""),
        ctrl_host=ctrl_host,
        ctrl_port=CTRL_PORT,
        slots=c.spec.decode.tilert.slots,
        max_seq_len=c.spec.model.max_seq_len,
    )
    cfg = router_render.config(
        c.spec,
        prefill_urls=[dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT)],
        tilert_nodes=[node],
        native_urls=[],
        api_keys_file=None,
    )
    if probes is None:
        probe = router_config.HandoffProbe()
    else:
        assert cfg.handoff_probe.interval_s > 0, "the operator renders the router with handoff probes on"
        probe = cfg.handoff_probe.model_copy(update=probes)
    cfg = cfg.model_copy(
        update={
            "health": router_config.HealthChecks(timeout_s=5.0, failures_to_eject=3),
            "handoff_probe": probe,
        }
    )
    cfg_file.write_text(router_config.dump(cfg))
    cmd = commands.router(
        c.spec,
        commands.Paths(model_dir=str(c.model_dir), router_config=str(cfg_file), router_port=ROUTER_PORT),
    )
    proc = bed.PodProcess(
        c.router,
        "router",
        local_plan._local_argv(cmd.argv),
        pod_env(c.router, c.family, dict(cmd.env)),
        c.log_dir,
    )
    c.procs["router"] = proc
    return proc


def wait_ready(c: Cluster, timeout: float = 120) -> None:
    try:
        bed.wait_http(c.router, c.node_url("/ready"), timeout, c.procs["node0"])
        bed.wait_http(
            c.router,
            dataplane.http_url(c.pod_ip(c.prefill), PREFILL_PORT) + "/health",
            timeout,
            c.procs["prefill"],
        )
        bed.wait_http(c.router, f"http://127.0.0.1:{ROUTER_PORT}/ready", timeout, c.procs["router"])
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{c.logs()}") from exc


@pytest.fixture(
    scope="module",
    params=[("mooncake", 4), ("nixl", 4), ("mooncake", 6), ("nixl", 6)],
    ids=["mooncake-ipv4", "nixl-ipv4", "mooncake-ipv6", "nixl-ipv6"],
)
def cluster(
    request: pytest.FixtureRequest,
    netns_available: None,
    tiny_model: Path,
    secret_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    engine, family = request.param
    tag = f"{engine[:2]}{family}"
    b = build_bed(tag, family)
    c = Cluster(
        engine, family, b, spec_for(engine), tmp_path_factory.mktemp(f"netns-{tag}"), model_dir=tiny_model
    )
    try:
        start_node(c, secret_file, network_status(c.node))
        start_prefill(c, secret_file)
        # The router's ctrl_host as the operator wires it (observe.py), from the same annotation.
        where = dataplane.choose(
            c.spec.transfer.rdma.networks, network_status(c.node), K8S_NAMESPACE, c.pod_ip(c.node)
        )
        assert where.address == c.rdma_ip(c.node), where
        start_router(c, where.address)
        wait_ready(c)
        yield c
    finally:
        c.stop()
        left = b.close()
        assert not left, f"namespaces that would not go: {left}"


def counters(c: Cluster) -> dict[str, dict[str, dict[str, int]]]:
    return {name: pod.counters() for name, pod in c.bed.pods.items() if not name.startswith("br-")}


def deltas(before: dict, after: dict) -> dict[str, dict[str, dict[str, int]]]:
    return {
        pod: {i: {k: after[pod][i][k] - v for k, v in kv.items()} for i, kv in ifs.items()}
        for pod, ifs in before.items()
    }


def settle(seconds: float = 0.3) -> None:
    # Counters are read after the peer's last segment is acknowledged.
    time.sleep(seconds)
