"""The API test server (pdc_apiserver) in a thread of its own, so that a blocking KopfRunner exit never
starves it, with the PDCluster CRD installed and its schema checked on every write as a real API
server does. The operator suite's `apiserver` fixture and the operator image's test
(tests/docker/test_images.py) each start one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pdc_apiserver
import pdc_crd_validator
import pdc_harness
import yaml

from tilert_operator import constants

T = TypeVar("T")
CRD = Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml"


class ServerThread:
    """Started serving on construction; `stop()` ends the server and its thread. `validate`: check
    PDCluster writes against the CRD's schema (the benchmarks leave it off: they time the operator,
    and measured without it before)."""

    def __init__(self, validate: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="apiserver", daemon=True)
        self._thread.start()
        self.server, self._srv = self.call(pdc_apiserver.serve())
        self.url = str(self._srv.url).rstrip("/")
        pdc_harness.install_crd(self, yaml.safe_load(CRD.read_text()))
        if not validate:
            return
        schema = pdc_crd_validator.load_schema()
        self.server.validators[(constants.GROUP, constants.VERSION, constants.PLURAL)] = lambda obj, old: (
            pdc_crd_validator.validate(obj, old, schema)
        )

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the server's loop (the server's state is the loop's alone)."""

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
