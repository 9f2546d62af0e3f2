"""TileRTConnector settings, read once from kv_connector_extra_config at construction.

Unknown or inconsistent keys fail at start, naming the key: a typo must not silently fall back to a
default on a production prefill.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tilert_serve import defaults, layouts, transfer

#: key -> (type, default or REQUIRED, help).
REQUIRED = object()
KEYS: dict[str, tuple[type, Any, str]] = {
    "tilert_model": (str, REQUIRED, "state layout family: glm5, deepseek_v3_2 or mla"),
    "tilert_max_seq_len": (int, REQUIRED, "longest prompt the TileRT pool takes; sizes the staging buffer"),
    "tilert_transfer": (str, "mooncake", "byte mover: mooncake or nixl"),
    "tilert_protocol": (str, "tcp", "tcp or rdma"),
    "tilert_secret_path": (str, defaults.SECRET_PATH, "file holding the handoff's shared secret"),
    "tilert_staging_requests": (int, 2, "requests whose state can wait in staging for the sender at once"),
    "tilert_local_host": (str, "", "address the decode nodes reach this worker's transfer engine at "
                                   "(default $POD_IP, else this host's address)"),
    "tilert_timeout_s": (float, 30.0, "seconds a handoff may take before it is failed"),
}
#: Keys people put in the static config that belong in each request's kv_transfer_params.
PER_REQUEST_KEYS = ("tilert_host", "tilert_ctrl_port", "tilert_ticket")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ConnectorConfig:
    tilert_model: str
    max_seq_len: int
    transfer: str
    protocol: str
    secret_path: str
    staging_requests: int
    local_host: str
    timeout_s: float

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        misplaced = [k for k in extra if k in PER_REQUEST_KEYS]
        if misplaced:
            raise ConfigError(f"kv_connector_extra_config has {misplaced}: the destination is per request; the "
                              "router puts tilert_host/tilert_ctrl_port/tilert_ticket in kv_transfer_params")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ConfigError(f"unknown TileRTConnector keys {unknown}; known keys: {sorted(KEYS)}")
        values: dict[str, Any] = {}
        for key, (typ, default, help_text) in KEYS.items():
            if key not in extra:
                if default is REQUIRED:
                    raise ConfigError(f"kv_connector_extra_config needs {key} ({help_text})")
                values[key] = default
                continue
            try:
                values[key] = typ(extra[key])
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{key}={extra[key]!r} is not a {typ.__name__} ({help_text})") from exc
        if values["tilert_model"] not in layouts.registry.MODELS:
            raise ConfigError(f"tilert_model={values['tilert_model']!r}: use one of {layouts.registry.MODELS}")
        if values["tilert_transfer"] not in transfer.ENGINES:
            raise ConfigError(f"tilert_transfer={values['tilert_transfer']!r}: use one of {transfer.ENGINES}")
        if values["tilert_protocol"] not in ("tcp", "rdma"):
            raise ConfigError(f"tilert_protocol={values['tilert_protocol']!r}: use tcp or rdma")
        for key in ("tilert_max_seq_len", "tilert_staging_requests"):
            if values[key] < 1:
                raise ConfigError(f"{key}={values[key]} must be at least 1")
        host = values["tilert_local_host"] or os.environ.get("POD_IP") or _own_address()
        return cls(tilert_model=values["tilert_model"], max_seq_len=values["tilert_max_seq_len"],
                   transfer=values["tilert_transfer"], protocol=values["tilert_protocol"],
                   secret_path=values["tilert_secret_path"], staging_requests=values["tilert_staging_requests"],
                   local_host=host, timeout_s=values["tilert_timeout_s"])


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
