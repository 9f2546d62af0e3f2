"""`make demo` in the suite, so it cannot rot: the local runner brings examples/tiny-cpu.yaml up
from the operator's rendered commands, both decode paths serve through the router, and `down`
leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tilert_serve.local.runner import free_port

pytestmark = pytest.mark.slow


def test_demo_serves_both_paths_and_cleans_up(tmp_path):
    home = tmp_path / "home"
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tilert_serve.local.demo",
            "--json",
            "--home",
            str(home),
            "--router-port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [r for r in lines if "route" in r]
    assert {r["route"] for r in results} == {"tilert", "native"}
    # Completions and a chat turn on each route.
    assert {(r["route"], r["api"]) for r in results} == {
        (route, api) for route in ("tilert", "native") for api in ("completions", "chat")
    }
    # Each request went the way it asked (the router's X-PD-Route says which way it went).
    assert [(r["route"], r["served_by"]) for r in results] == [(r["route"], r["route"]) for r in results], (
        results
    )
    for r in results:
        assert r["chunks"] >= 1 and r["text"], r
        assert r["ttft_ms"] > 0
    tilert = [r for r in results if r["route"] == "tilert"]
    assert all(r["handoff_ms"] > 0 and 0.0 <= r["mtp_acceptance"] <= 1.0 for r in tilert), tilert
    assert any(r["mtp_acceptance"] > 0 for r in tilert)
    assert lines[-1]["summary"] and lines[-1]["requests"] == len(results)
    # `down` ran: the state file is gone and every recorded process has exited.
    assert not list(home.glob("*/state.json"))
    out = subprocess.run(
        [sys.executable, "-m", "tilert_serve.cli", "local", "status", "--json", "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == []


def test_local_up_refuses_a_bad_spec_with_the_field_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: pd.tilert.ai/v1alpha1\nkind: PDCluster\nmetadata: {name: bad}\nspec:\n"
        "  model: {name: m, weights: {tiny: true}, tilertModel: mla}\n"
        "  decode: {tilert: {replicas: 0}, native: {replicas: 0}}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tilert_serve.cli",
            "local",
            "up",
            "-f",
            str(bad),
            "--home",
            str(tmp_path / "h"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert proc.returncode == 1
    assert "not a valid PDCluster" in proc.stderr and "spec.decode" in proc.stderr
