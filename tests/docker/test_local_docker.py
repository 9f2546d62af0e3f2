"""`tilert-pd local up --runtime docker`: the operator's rendered manifests run as containers of the
images `make images` builds, and the stack they make serves what vLLM alone serves.

Each pod is a container of its own image with the pod's command, environment (downward API filled
in), Secret and ConfigMap files and probes; Services are DNS names on a Docker network that plays the
pod network. The oracle is a plain vLLM on the host over the very checkpoint the pods' init
containers generated (their emptyDir is a directory on the host).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.docker.conftest import Images
from tests.e2e.conftest import vllm_argv
from tests.e2e.procs import PY, Proc
from tilert_operator.cli_render import render_document
from tilert_serve.local import docker, docker_runtime
from tilert_serve.local.runner import free_port
from tilert_serve.router import config as router_config

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
MODEL = yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["name"]
PROMPTS: list[str | list[int]] = [[10, 20, 30], "Prefill is compute-bound; de", "Once upon a time there"]
LOCAL = [PY, "-m", "tilert_serve.cli", "local"]


@dataclass
class Stack:
    home: Path
    state: dict[str, Any]
    router: openai.OpenAI
    plain: openai.OpenAI
    up_output: str


@pytest.fixture(scope="module")
def stack(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("docker-home")
    up = subprocess.run(
        [*LOCAL, "up", "-f", str(EXAMPLE), "--runtime", "docker", "--home", str(home), "--timeout", "900"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    plain: Proc | None = None
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        state = json.loads((home / "tiny" / "state.json").read_text())
        # The checkpoint the prefill pod's init container wrote into its emptyDir.
        model_dir = home / "tiny" / "pods" / "tiny-prefill-0" / "volumes" / "model"
        port = free_port()
        argv = vllm_argv(model_dir, port, None)
        argv[argv.index("--served-model-name") + 1] = MODEL
        plain = Proc("plain", argv, home)
        plain.wait_ready(f"http://127.0.0.1:{port}/health", 600)
        yield Stack(
            home,
            state,
            openai.OpenAI(base_url=f"{state['router']}/v1", api_key="none", max_retries=0, timeout=300),
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0),
            up.stdout,
        )
    finally:
        if plain is not None:
            plain.stop()
        subprocess.run([*LOCAL, "down", "--home", str(home)], capture_output=True, timeout=300, cwd=ROOT)


def _complete(
    client: openai.OpenAI, prompt: str | list[int], max_tokens: int, stream: bool, route: str | None = None
) -> tuple[str, str | None]:
    kw: dict[str, Any] = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"x-pd-route": route} if route else None,
    )
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_every_pod_runs_its_image_and_is_ready_by_its_own_probe(stack: Stack, images: Images) -> None:
    pods = {p["name"]: p for p in stack.state["pods"]}
    assert set(pods) == {
        "tiny-prefill-0",
        "tiny-tilert-decode-0",
        "tiny-tilert-decode-1",
        "tiny-native-decode-0",
        "tiny-router-0",
    }
    assert pods["tiny-router-0"]["image"] == images.serve_cpu
    assert pods["tiny-prefill-0"]["image"] == images.vllm_prefill_cpu
    # The decode nodes are ready by /ready (a loaded engine), not by the process being up.
    assert any(r["path"] == "/ready" for r in pods["tiny-tilert-decode-0"]["readiness"])
    status = subprocess.run(
        [*LOCAL, "status", "--json", "--home", str(stack.home)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    rows = json.loads(status.stdout)
    assert {r["name"] for r in rows} == set(pods) and all(r["ready"] for r in rows), rows


@pytest.mark.parametrize("route", ["tilert", "native"])
@pytest.mark.parametrize("stream", [False, True])
def test_both_routes_equal_vllm_alone(stack: Stack, route: str, stream: bool) -> None:
    for prompt in PROMPTS if route == "tilert" else PROMPTS[:2]:
        want = _complete(stack.plain, prompt, 8, stream=False)
        got = _complete(stack.router, prompt, 8, stream=stream, route=route)
        assert got == want, (route, prompt)


def test_chat_on_the_tilert_route(stack: Stack) -> None:
    messages: Any = [{"role": "user", "content": "What is a token?"}]
    want = stack.plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    got = stack.router.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_headers={"x-pd-route": "tilert"}
    )
    assert got.choices[0].message.content == want.choices[0].message.content


def test_down_removes_every_container_and_network(images: Images, tmp_path: Path) -> None:
    # A run of its own (the router alone), so the module's stack is not disturbed. A router alone cannot
    # route, so its /ready never passes: the process being up (/health) is what this test needs.
    manifests = [
        m
        for m in _manifests()
        if m["kind"] in ("ConfigMap", "Secret") or m["metadata"]["name"] == "tiny-router"
    ]
    router = next(m for m in manifests if m["kind"] == "Deployment")
    router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/health"
    docker_runtime.up(manifests, "tpd-down-test", tmp_path, 120, lambda _: None)
    assert docker.containers("tpd-down-test") and docker.networks("tpd-down-test")
    removed = docker_runtime.cleanup("tpd-down-test", tmp_path)
    assert removed == 1
    assert not docker.containers("tpd-down-test") and not docker.networks("tpd-down-test")
    assert (tmp_path / "logs" / "tpd-tpd-down-test-tiny-router-0-router.log").exists()


def test_a_probe_that_never_succeeds_fails_up_with_its_reason(images: Images, tmp_path: Path) -> None:
    manifests = [
        m
        for m in _manifests()
        if m["kind"] in ("ConfigMap", "Secret") or m["metadata"]["name"] == "tiny-router"
    ]
    router = next(m for m in manifests if m["kind"] == "Deployment")
    router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/no-such-path"
    with pytest.raises(docker_runtime.StartFailed) as err:
        docker_runtime.up(manifests, "tpd-probe-test", tmp_path, 30, lambda _: None)
    assert "/no-such-path" in str(err.value) and "HTTP 404" in str(err.value)
    # Nothing is left behind by a failed start.
    assert not docker.containers("tpd-probe-test") and not docker.networks("tpd-probe-test")


def _manifests() -> list[dict[str, Any]]:
    return render_document(yaml.safe_load(EXAMPLE.read_text()), None, with_secret=True)


def test_secondary_network_carries_the_handoff(images: Images, tmp_path: Path) -> None:
    """With `transfer.rdma.networks` named, each pod gets a second network (the Multus one), the node
    finds its data-plane address in the network-status file written as Multus would, the router's
    config lists it at that address (no DNS discovery: the list is all the router routes), and the KV
    state crosses that network, not the pod network (interface counters of the decode pod)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "mnet"
    doc["spec"]["transfer"]["rdma"] = {"networks": ["rdma-a"]}
    doc["spec"]["decode"]["tilert"]["replicas"] = 1
    doc["spec"]["decode"]["native"]["replicas"] = 0
    doc["spec"]["prefill"]["nativeConnector"] = "none"
    spec_file = tmp_path / "mnet.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    home = tmp_path / "home"
    try:
        up = subprocess.run(
            [
                *LOCAL,
                "up",
                "-f",
                str(spec_file),
                "--runtime",
                "docker",
                "--home",
                str(home),
                "--timeout",
                "900",
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=ROOT,
        )
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        assert "secondary networks tpd-mnet-rdma-a" in up.stdout
        state = json.loads((home / "mnet" / "state.json").read_text())
        node = next(p for p in state["pods"] if p["component"] == "tilert-decode")
        status = json.loads(
            (home / "mnet" / "pods" / node["name"] / "volumes" / "podinfo" / "network-status").read_text()
        )
        rdma = next(e for e in status if e["name"] == "default/rdma-a")
        # The router's config lists the node at its address on that network, as the operator wires it,
        # and finds no node through DNS (which would name it by its pod IP).
        cfg = router_config.load(
            home / "mnet" / "pods" / "mnet-router-0" / "volumes" / "config" / "config.yaml"
        )
        assert [(n.name, n.http_url, n.ctrl_host) for n in cfg.tilert] == [
            (node["name"], node["url"], rdma["ips"][0])
        ] and cfg.discoveries() == [], cfg
        assert f"{node['name']} (data plane {rdma['ips'][0]})" in up.stdout
        container = node["containers"][0]
        before = docker.received_bytes(container)
        client = openai.OpenAI(base_url=f"{state['router']}/v1", api_key="none", max_retries=0, timeout=300)
        r = client.completions.with_raw_response.create(
            model=MODEL,
            prompt="Once upon a time " * 40,
            max_tokens=4,
            temperature=0,
            extra_headers={"x-pd-route": "tilert"},
        )
        assert r.headers.get("x-pd-route") == "tilert"
        after = docker.received_bytes(container)
        on_rdma = after[rdma["interface"]] - before[rdma["interface"]]
        on_pod = after["eth0"] - before["eth0"]
        # Several MB of float32 MLA state on the second network; only HTTP and control frames on eth0.
        assert on_rdma > 1_000_000 and on_pod < on_rdma / 10, (on_rdma, on_pod)
    finally:
        subprocess.run([*LOCAL, "down", "--home", str(home)], capture_output=True, timeout=300, cwd=ROOT)
    assert not docker.containers("mnet")
