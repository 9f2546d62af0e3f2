"""TileRTConnector settings, read once from kv_connector_extra_config at construction.

Unknown or inconsistent keys fail at start, naming the key: a typo must not silently fall back to a
default on a production prefill. Each field is spelled in the extra config as its alias
(`tilert_max_seq_len`), which is also what errors name.

`tilert_layerwise` is on by default: each main layer's state leaves as the forward finishes it and the
node checks and converts it while later layers compute (worker.py, decode/node.py), so only the last
layers, the MTP layer (after the drafter) and injection remain when the prefill's forward ends. It
keeps every property of the whole-state handoff (exact equality with vLLM's greedy output in
tests/e2e/test_pd_vllm.py, MTP from step one, blocks held until every layer is staged, integrity
checked before injection) and falls back to the whole state by itself toward a node that does not offer
it or with digests off. Turn it off to save its per-layer control frames and hooks where a handoff is
too small for overlap to matter; a request can also choose with `tilert_layerwise` in its
kv_transfer_params (metadata.py). With chunked prefill (a long prompt over several steps) each step's
tokens leave during that step, when a staging region is free for the request while another stays free
for prompts that complete (so `tilert_staging_requests` of 1 sends a chunked prompt in its last step).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tilert_serve import dataplane, defaults, layouts, pydantic_errors, transfer
from tilert_serve.pd_vllm import pending

#: Keys people put in the static config that belong in each request's kv_transfer_params.
PER_REQUEST_KEYS = ("tilert_host", "tilert_ctrl_port", "tilert_ticket")


class ConfigError(ValueError):
    pass


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tilert_model: str = Field(description="state layout family: glm5, deepseek_v3_2 or mla")
    max_seq_len: int = Field(
        alias="tilert_max_seq_len",
        ge=1,
        description="longest prompt the TileRT pool takes; sizes the staging buffer",
    )
    transfer: str = Field("mooncake", alias="tilert_transfer", description="byte mover: mooncake or nixl")
    protocol: Literal["tcp", "rdma"] = Field("tcp", alias="tilert_protocol", description="tcp or rdma")
    secret_path: str = Field(
        defaults.SECRET_PATH,
        alias="tilert_secret_path",
        description="file holding the handoff's shared secret (re-read when it changes)",
    )
    staging_requests: int = Field(
        2,
        alias="tilert_staging_requests",
        ge=1,
        description="requests whose state can wait in staging for the sender at once; a "
        "chunked prompt sent step by step holds one from its first "
        "step, and may take one only while another stays free",
    )
    local_host: str = Field(
        "",
        alias="tilert_local_host",
        validate_default=True,
        description="address the decode nodes reach this worker's transfer engine at "
        "(default $POD_IP, else this host's address; unused with "
        "tilert_data_plane_networks)",
    )
    data_plane_networks: tuple[str, ...] = Field(
        (),
        alias="tilert_data_plane_networks",
        description="Multus networks of the handoff (spec.transfer.rdma."
        "networks): the transfer engine runs on this pod's "
        "address on the first, read from "
        "tilert_network_status_file",
    )
    network_status_file: str = Field(
        dataplane.NETWORK_STATUS_FILE,
        alias="tilert_network_status_file",
        description="the pod's Multus network-status annotation, mounted by the downward API",
    )
    timeout_s: float = Field(
        30.0,
        alias="tilert_timeout_s",
        description="seconds a handoff may wait for the node, or for the prefill to stage a "
        "further layer (one step), before it is failed",
    )
    handoff_digest: bool = Field(
        True,
        alias="tilert_handoff_digest",
        description="send a digest of the written state in Done, which the decode nodes "
        "check before decoding (they refuse a state without one unless run "
        "with --handoff-digest off)",
    )

    pending_dir: str = Field(
        pending.DEFAULT_DIR,
        alias="tilert_pending_dir",
        description="directory (this user's alone, created 0700) where each worker keeps its count "
        "of handoffs still to send, which `tilert-pd wait-idle --pending-dir` reads in the "
        "pod's preStop hook",
    )
    model_revision: str = Field(
        "",
        alias="model_revision",
        max_length=128,
        description="what identifies the weights (a checkpoint revision, a date): with the served "
        "model name and the layout, this prefill's compatibility generation, which its "
        "handoffs and responses carry; the decode nodes' --model-revision must be the same",
    )

    layerwise: bool = Field(
        True,
        alias="tilert_layerwise",
        description="hand each layer's state over as the forward finishes it (the node checks "
        "and converts it while later layers compute); off, the whole state "
        "moves after the forward. Nodes that do not offer it get the whole state",
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        try:
            return cls.model_validate(dict(extra))
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from exc

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, extra: Any) -> Any:
        # Checked before the fields so that the message lists every known key, and says where a
        # per-request key belongs, instead of pydantic's one "extra inputs" error per key.
        if not isinstance(extra, Mapping):
            return extra
        misplaced = [k for k in extra if k in PER_REQUEST_KEYS]
        if misplaced:
            raise ValueError(
                f"kv_connector_extra_config has {misplaced}: the destination is per request; the "
                "router puts tilert_host/tilert_ctrl_port/tilert_ticket in kv_transfer_params"
            )
        known = {f.alias or name for name, f in cls.model_fields.items()}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown TileRTConnector keys {unknown}; known keys: {sorted(known)}")
        return extra

    @field_validator("tilert_model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in layouts.registry.MODELS:
            raise ValueError(f"use one of {layouts.registry.MODELS}")
        return value

    @field_validator("transfer")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in transfer.ENGINES:
            raise ValueError(f"use one of {transfer.ENGINES}")
        return value

    @field_validator("local_host")
    @classmethod
    def _default_host(cls, value: str) -> str:
        return value or os.environ.get("POD_IP") or _own_address()


def _explain(exc: ValidationError) -> str:
    """pydantic's problems, each with the key's meaning (what a missing key is for, what a wrong
    value should have been)."""
    help_of = {f.alias or name: f.description for name, f in ConnectorConfig.model_fields.items()}
    parts = []
    for path, message in pydantic_errors.problems(exc, show_input=True):
        # A problem with no path is about the whole config (unknown or misplaced keys) and says it all.
        parts.append(f"kv_connector_extra_config.{path}: {message} ({help_of[path]})" if path else message)
    return "; ".join(parts)


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
