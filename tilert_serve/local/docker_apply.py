"""`tilert-pd local apply` for the docker runtime (filled in below)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def apply(
    args: argparse.Namespace, name: str, state_dir: Path, state: dict[str, Any], say: Callable[[str], None]
) -> int:
    raise ValueError("apply for --runtime docker is not written yet")
