"""Fixtures for the operator suite: a Kubernetes API test server in its own thread (so a blocking
KopfRunner exit never starves it), a kubeconfig pointing at it, and the CRD installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helper modules next to the tests

import pdc_apiserver
from pdc_server_thread import ServerThread


@pytest.fixture()
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    st = ServerThread()
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(pdc_apiserver.kubeconfig(st.url))
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    st.kubeconfig = str(cfg)  # type: ignore[attr-defined]
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(autouse=True)
def _no_handoff_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pods here are API objects with no decode node behind them: the operator's HandoffReady check
    (operator/tilert_operator/handoff.py) is on only in tests that serve a node's /v1/status."""
    monkeypatch.setenv("TILERT_PD_HANDOFF_CHECK", "0")
