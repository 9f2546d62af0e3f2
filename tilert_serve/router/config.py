"""The router's configuration: what the operator writes into the router's ConfigMap (config.yaml) and
what `tilert-pd local` writes for local runs. One model, parsed in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tilert_serve import defaults


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TileRTNode(_Strict):
    """One TileRT decode node (a pod of the TileRT StatefulSet)."""

    name: str
    #: Base URL of the node's HTTP API (admit, generate, cancel, health).
    http_url: str
    #: Where the prefill's sender reaches the node's control plane (passed in kv_transfer_params).
    ctrl_host: str
    ctrl_port: int = defaults.DECODE_CTRL_PORT
    slots: int = Field(default=1, ge=1)


class RoutingPolicy(_Strict):
    #: Request header that picks the path: tilert | native | auto.
    header: str = "x-pd-route"
    #: Model names (aliases) that always go to TileRT / to the native pool.
    tilert_aliases: list[str] = []
    native_aliases: list[str] = []
    #: Path for requests that name neither alias nor header. auto = TileRT when a slot is free.
    default: Literal["auto", "tilert", "native"] = "auto"
    #: What happens when TileRT is asked for but has no free slot.
    when_tilert_full: Literal["native", "reject"] = "native"
    #: What happens to requests using features the TileRT engine lacks (penalties, grammars, ...).
    unsupported_on_tilert: Literal["native", "reject"] = "native"
    retry_after_s: int = Field(default=1, ge=0)


class Timeouts(_Strict):
    connect_s: float = 5.0
    #: Prefill of the whole prompt, first token included.
    prefill_s: float = 600.0
    #: Between two tokens of a decode stream.
    idle_stream_s: float = 60.0


class RouterConfig(_Strict):
    #: The served model name clients use.
    model: str
    #: Base URLs of the vLLM prefill servers.
    prefill: list[str]
    tilert: list[TileRTNode] = []
    #: Base URLs of the native vLLM decode servers.
    native: list[str] = []
    policy: RoutingPolicy = RoutingPolicy()
    timeouts: Timeouts = Timeouts()
    #: File with one API key per line; None = no authentication.
    api_keys_file: str | None = None


def load(path: str | Path) -> RouterConfig:
    """Parse a config file; errors name the field (pydantic's messages)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return RouterConfig.model_validate(data)


def dump(config: RouterConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
