"""Fixtures for the operator suite: a Kubernetes API test server in its own thread (so a blocking
KopfRunner exit never starves it), a kubeconfig pointing at it, and the CRD installed."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # helper modules next to the tests

import pdc_apiserver
import pdc_crd_validator
import pdc_harness

T = TypeVar("T")
CRD = Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml"


class ServerThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="apiserver", daemon=True)
        self._thread.start()
        self.server, self._srv = self.call(pdc_apiserver.serve())
        self.url = str(self._srv.url).rstrip("/")

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return self.call(run())

    def stop(self) -> None:
        async def down() -> None:
            await self._srv.__aexit__(None, None, None)
            try:
                await self.server.__aexit__(None, None, None)
            except Exception:  # kmock re-raises errors it served (e.g. cancelled watches): not ours
                pass

        try:
            self.call(down(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


@pytest.fixture()
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    st = ServerThread()
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(pdc_apiserver.kubeconfig(st.url))
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    st.kubeconfig = str(cfg)  # type: ignore[attr-defined]
    pdc_harness.install_crd(st, yaml.safe_load(CRD.read_text()))
    schema = pdc_crd_validator.load_schema()
    st.server.validators[("pd.tilert.ai", "v1alpha1", "pdclusters")] = lambda obj, old: (
        pdc_crd_validator.validate(obj, old, schema)
    )
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(autouse=True)
def _no_handoff_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pods here are API objects with no decode node behind them: the operator's HandoffReady check
    (operator/tilert_operator/handoff.py) is on only in tests that serve a node's /v1/status."""
    monkeypatch.setenv("TILERT_PD_HANDOFF_CHECK", "0")
