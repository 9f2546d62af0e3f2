"""The chart loaded once with the real Helm engine (helm-python-sdk).

Helm prints an INFO line on stderr for every symlink it follows while loading (crds/ and
files/rbac.yaml are symlinks by design); pytest captures it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "tilert-pd"


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the Helm engine) is a dev dependency")
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
