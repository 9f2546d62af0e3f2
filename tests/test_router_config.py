import pytest
from pydantic import ValidationError

from tilert_serve.router import config


def test_roundtrip_through_yaml(tmp_path):
    cfg = config.RouterConfig(
        model="tiny",
        prefill=["http://127.0.0.1:8100"],
        tilert=[config.TileRTNode(name="t0", http_url="http://127.0.0.1:5557", ctrl_host="127.0.0.1")],
    )
    path = tmp_path / "config.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path) == cfg


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: m\nprefill: []\nprefil_typo: 1\n")
    with pytest.raises(ValidationError, match="prefil_typo"):
        config.load(path)


def test_issue_10_fields_default_to_a_closed_router(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: m\nprefill: []\n")
    cfg = config.load(path)
    # /metrics needs a key whenever keys are configured; no node token is sent unless one is mounted.
    assert cfg.metrics_public is False and cfg.tilert_api_token_file is None
    # Idle and half-sent-header connections are closed in seconds, not aiohttp's hour.
    assert cfg.timeouts.client_idle_s == 15.0 and cfg.timeouts.client_body_s == 30.0
    path.write_text("model: m\nprefill: []\ntimeouts: {client_idle_s: 0}\n")
    with pytest.raises(ValidationError, match="client_idle_s"):
        config.load(path)


def test_a_missing_token_file_stops_the_router_with_its_path(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "config.yaml"
    missing = tmp_path / "no-such-token"
    path.write_text(f"model: m\nprefill: []\ntilert_api_token_file: {missing}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tilert_serve.router.cli", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"router: cannot read the token file {missing}" in proc.stderr
