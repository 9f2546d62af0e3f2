"""The PD stack on CPU for end-to-end tests: a tiny generated model, a TileRT decode node on the
reference engine, a vLLM prefill with MultiConnector[TileRTConnector, NixlConnector] and MTP, and a
plain vLLM (no connector) as the baseline; for the native path, a native vLLM decode (NixlConnector)
and the router in front of the same prefill.

vLLM takes 30-60 s to boot on a 2-core box, so each process starts once per session and is shared by
every module that needs it: the plain vLLM by test_pd_vllm, test_native_connectors and
test_stack_openai (it serves the generated checkpoint under both the name these tests use and the
example's model name: `tilert-pd tiny-model` writes the same bytes as TinySpec()); the prefill and the
node by test_pd_vllm and test_native_connectors (their prefill configurations were the same). No test
breaks the shared processes: the node a test kills is its own (test_failed_handoffs_...)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.procs import PY, Proc
from tilert_serve import vllm_cpu
from tilert_serve.local.runner import free_port

MAX_SEQ_LEN = 512
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 1, **vllm_cpu.drafter_config()})
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
#: The example's served model name: the plain vLLM answers to it too (test_stack_openai).
EXAMPLE_MODEL = yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["name"]
#: The modules' order in a session (the rest keep theirs, after these): test_stack_openai brings up its
#: own stack (`tilert-pd local up`, torn down with its module) beside the shared plain vLLM only, before
#: the shared prefill, node and native decode start, so that at most one stack runs at a time.
MODULE_ORDER = ("test_demo.py", "test_stack_openai.py", "test_native_connectors.py", "test_pd_vllm.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def key(item: pytest.Item) -> int:
        path = Path(str(item.path))
        if path.parent != here or path.name not in MODULE_ORDER:
            return -1 if path.parent != here else len(MODULE_ORDER)
        return MODULE_ORDER.index(path.name)

    # Only the e2e items move, among the positions they already hold (a stable sort keeps each
    # module's own order).
    slots = [i for i, item in enumerate(items) if Path(str(item.path)).parent == here]
    ordered = sorted((items[i] for i in slots), key=key)
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


#: The session's shared processes (plain vLLM, prefill, node, native decode, router): stopped after the
#: last e2e test, not at the end of the session, so that they do not sit beside the directories that
#: run after this one. (Their fixtures stop them again at the session's end: stop is idempotent.)
_SHARED: list[Proc] = []


def _in_e2e(item: pytest.Item | None) -> bool:
    return item is not None and Path(str(item.path)).parent == Path(__file__).parent


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _in_e2e(item) and not _in_e2e(nextitem):
        for p in reversed(_SHARED):
            p.stop()


@dataclass
class Stack:
    model_dir: Path
    secret_file: Path
    prefill_url: str
    plain_url: str
    node_url: str
    ctrl_port: int
    procs: dict[str, Proc]
    log_dir: Path
    #: The native decode's port once it was started (native below), else 0.
    decode_port: int = 0


@dataclass
class Native:
    connector: str
    router_url: str
    prefill_url: str
    decode_url: str
    procs: dict[str, Proc]


def vllm_argv(
    model_dir: Path, port: int, kv_transfer_config: dict | None, served_names: tuple[str, ...] = ("tiny",)
) -> list[str]:
    argv = [
        PY,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        *served_names,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_SEQ_LEN),
        "--gpu-memory-utilization",
        "0.3",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--speculative-config",
        MTP,
        *vllm_cpu.serve_args(),
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return argv


def prefill_kv_config(secret_file: Path) -> dict:
    tilert = {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert_serve.pd_vllm.prefill_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "tilert_model": "mla",
            "tilert_max_seq_len": MAX_SEQ_LEN,
            "tilert_secret_path": str(secret_file),
            "tilert_local_host": "127.0.0.1",
            "tilert_timeout_s": 5,
            "tilert_staging_requests": 2,
        },
    }
    native = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [tilert, native]},
    }


def start_node(
    stack_dir: Path, model_dir: Path, secret_file: Path, name: str, slots: int = 4
) -> tuple[Proc, str, int]:
    http, ctrl = free_port(), free_port()
    proc = Proc(
        name,
        [
            PY,
            "-m",
            "tilert_serve.cli",
            "decode-node",
            "--model-dir",
            str(model_dir),
            "--tilert-model",
            "mla",
            # The prefill serves the model as "tiny": the node's compatibility generation names it too.
            "--served-model-name",
            "tiny",
            "--engine",
            "reference",
            "--slots",
            str(slots),
            "--max-seq-len",
            str(MAX_SEQ_LEN),
            "--host",
            "127.0.0.1",
            "--advertise-host",
            "127.0.0.1",
            "--ctrl-port",
            str(ctrl),
            "--http-port",
            str(http),
            "--secret-file",
            str(secret_file),
            "--dtype",
            "float32",
            "--name",
            name,
        ],
        stack_dir,
    )
    return proc, f"http://127.0.0.1:{http}", ctrl


@dataclass
class Model:
    root: Path
    model_dir: Path
    secret_file: Path


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    from tilert_serve.tinymodel.generate import TinySpec, generate

    root = tmp_path_factory.mktemp("pd-stack")
    generate(TinySpec(), root / "tiny")
    (root / "secret").write_text(secrets.token_hex(32))
    return Model(root, root / "tiny", root / "secret")


class Plain:
    """The baseline vLLM, started when first asked for and waited for only where it is used (so that
    it boots beside whatever the asking fixture starts next)."""

    def __init__(self, model: Model) -> None:
        self.port = free_port()
        self.proc = Proc(
            "plain", vllm_argv(model.model_dir, self.port, None, ("tiny", EXAMPLE_MODEL)), model.root
        )
        _SHARED.append(self.proc)
        self._ready = False

    @property
    def url(self) -> str:
        if not self._ready:
            self.proc.wait_ready(f"http://127.0.0.1:{self.port}/health", 600)
            self._ready = True
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def plain_vllm(e2e_model: Model) -> Iterator[Plain]:
    plain = Plain(e2e_model)
    try:
        yield plain
    finally:
        plain.proc.stop()


def _wants_native(session: pytest.Session) -> bool:
    return any("native" in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest, e2e_model: Model, plain_vllm: Plain) -> Iterator[Stack]:
    root, model_dir, secret_file = e2e_model.root, e2e_model.model_dir, e2e_model.secret_file
    procs: dict[str, Proc] = {}
    decode_port = 0
    try:
        node, node_url, ctrl = start_node(root, model_dir, secret_file, "decode-node")
        procs["node"] = node
        _SHARED.append(node)
        p_port = free_port()
        procs["prefill"] = Proc(
            "prefill", vllm_argv(model_dir, p_port, prefill_kv_config(secret_file)), root, nixl_env()
        )
        _SHARED.append(procs["prefill"])
        if _wants_native(request.session):  # boots beside the prefill (native below)
            procs["decode"], decode_port = _start_native_decode(model_dir, root)
        node.wait_ready(f"{node_url}/ready", 120)
        procs["prefill"].wait_ready(f"http://127.0.0.1:{p_port}/health", 600)
        yield Stack(
            model_dir,
            secret_file,
            f"http://127.0.0.1:{p_port}",
            plain_vllm.url,
            node_url,
            ctrl,
            procs,
            root,
            decode_port,
        )
    finally:
        for p in procs.values():
            p.stop()


NATIVE_CONNECTOR = "NixlConnector"


def nixl_env() -> dict[str, str]:
    """A vLLM with NixlConnector: its own NIXL side-channel port (vLLM's default, 5600, may be taken by
    another stack here), and a CPU pool's environment as the operator renders it (vllm_cpu.serve_env:
    a core left for the engine)."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        **vllm_cpu.serve_env(),
    }


def _start_native_decode(model_dir: Path, root: Path) -> tuple[Proc, int]:
    d_kv = {"kv_connector": NATIVE_CONNECTOR, "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    port = free_port()
    proc = Proc("decode", vllm_argv(model_dir, port, d_kv), root, nixl_env())
    _SHARED.append(proc)
    return proc, port


@pytest.fixture(scope="session")
def native(stack: Stack) -> Iterator[Native]:
    """The native path on the shared prefill (its NixlConnector is the MultiConnector's second): a native
    vLLM decode reading the KV with NixlConnector, and the router in front, native by default."""
    procs: dict[str, Proc] = {}
    try:
        if "decode" not in stack.procs:
            stack.procs["decode"], stack.decode_port = _start_native_decode(stack.model_dir, stack.log_dir)
        d_port = stack.decode_port
        r_port = free_port()
        cfg = {
            "model": "tiny",
            "prefill": [stack.prefill_url],
            "native": [f"http://127.0.0.1:{d_port}"],
            "policy": {"default": "native"},
            "native_connector": NATIVE_CONNECTOR,
        }
        (stack.log_dir / "router.yaml").write_text(yaml.safe_dump(cfg))
        procs["router"] = Proc(
            "router",
            [
                PY,
                "-m",
                "tilert_serve.router.cli",
                "--config",
                str(stack.log_dir / "router.yaml"),
                "--host",
                "127.0.0.1",
                "--port",
                str(r_port),
            ],
            stack.log_dir,
        )
        _SHARED.append(procs["router"])
        stack.procs["decode"].wait_ready(f"http://127.0.0.1:{d_port}/health", 600)
        procs["router"].wait_ready(f"http://127.0.0.1:{r_port}/health", 60)
        yield Native(
            NATIVE_CONNECTOR,
            f"http://127.0.0.1:{r_port}",
            stack.prefill_url,
            f"http://127.0.0.1:{d_port}",
            {"prefill": stack.procs["prefill"], "decode": stack.procs["decode"], **procs},
        )
    finally:
        for p in procs.values():
            p.stop()
