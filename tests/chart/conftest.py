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
    # A plain import: make setup checks that the Helm engine loads, so a broken install fails here
    # instead of skipping every chart test.
    import helm_python as helm

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
