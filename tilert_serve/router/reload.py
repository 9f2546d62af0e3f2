"""Reload the config file without a restart.

Kubernetes updates a mounted ConfigMap by swapping a `..data` symlink to a new directory, so the
file's path stays the same while what it points to changes. The watcher polls `os.stat` of the path
(which follows symlinks) and reloads when the inode, size or mtime changed; it keeps the old config
when the new one does not parse, and says so in the log and in tilert_router_config_reloads_total.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from tilert_serve.bearer import TokenFileError
from tilert_serve.router import config as config_mod
from tilert_serve.router.state import RouterState, task_ctx

log = logging.getLogger(__name__)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        s = os.stat(path)
    except OSError:
        return None
    return (s.st_ino, s.st_size, s.st_mtime_ns)


def reload_now(state: RouterState) -> bool:
    """Load the file and apply it; False (old config kept) when it is missing or invalid."""
    assert state.config_path is not None
    try:
        new = config_mod.load(state.config_path)
        state.apply(new)  # also when equal: the token files are re-read at once
    except (OSError, ValueError, ValidationError, yaml.YAMLError, TokenFileError) as exc:
        state.metrics.config_reloads.labels("error").inc()
        log.error("config %s not reloaded, keeping the old one: %s", state.config_path, exc)
        return False
    state.metrics.config_reloads.labels("ok").inc()
    log.info(
        "config %s reloaded: %d prefill, %d TileRT, %d native",
        state.config_path,
        len(new.prefill),
        len(new.tilert),
        len(new.native),
    )
    return True


async def _watch(state: RouterState) -> None:
    if state.config_path is None:  # a fixed config: nothing to watch
        return
    last = _signature(state.config_path)
    while True:
        await asyncio.sleep(state.config.reload_interval_s)
        sig = _signature(state.config_path)
        if sig is not None and sig != last:
            last = sig
            try:
                reload_now(state)
            except Exception:  # a bad reload must never stop the watcher
                log.exception("config reload failed")


#: cleanup_ctx: watch the config file when the app was built from one.
reload_ctx = task_ctx(_watch)
