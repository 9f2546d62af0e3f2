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
