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


def test_endpoints_take_a_url_or_a_url_with_its_generation(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "model: m\n"
        "prefill: [http://p0, {url: http://p1, compat: aaaaaaaaaaaa}]\n"
        "native: [http://n0]\n"
        "tilert: [{name: t0, http_url: http://t0, ctrl_host: h, compat: aaaaaaaaaaaa}]\n"
    )
    cfg = config.load(path)
    assert cfg.prefill == [
        config.Endpoint(url="http://p0"),
        config.Endpoint(url="http://p1", compat="aaaaaaaaaaaa"),
    ]
    assert cfg.native == [config.Endpoint(url="http://n0", compat=None)]
    assert cfg.tilert[0].compat == "aaaaaaaaaaaa"
    # The constructor takes the older forms too (the operator's and `tilert-pd local`'s renderers).
    assert config.RouterConfig(model="m", prefill=["http://p0"]).prefill == [config.Endpoint(url="http://p0")]
    path.write_text("model: m\nprefill: [{url: http://p0, compat: x, comapt: y}]\n")
    with pytest.raises(ValidationError, match="comapt"):
        config.load(path)


def test_discovery_is_a_list_and_a_single_mapping_is_one_item(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: m\nprefill: []\ntilert_discovery: {service: a.svc, compat: aaaaaaaaaaaa}\n")
    one = config.load(path)
    assert [(d.service, d.compat) for d in one.tilert_discovery] == [("a.svc", "aaaaaaaaaaaa")]
    path.write_text(
        "model: m\nprefill: []\ntilert_discovery: [{service: a.svc}, {service: b.svc, compat: b}]\n"
    )
    two = config.load(path)
    assert [(d.service, d.compat) for d in two.discoveries()] == [("a.svc", None), ("b.svc", "b")]
    path.write_text("model: m\nprefill: []\ntilert_discovery: null\n")
    assert config.load(path).discoveries() == []
    # model_copy(update=...) does not validate: a single entry set that way still reads as a list.
    d = config.TileRTDiscovery(service="c.svc")
    assert config.RouterConfig(model="m", prefill=[]).model_copy(
        update={"tilert_discovery": d}
    ).discoveries() == [d]


def test_dump_writes_the_older_shape_where_it_means_the_same(tmp_path):
    import yaml

    plain = config.RouterConfig(
        model="m",
        prefill=["http://p0"],
        tilert=[config.TileRTNode(name="t0", http_url="http://t0", ctrl_host="h")],
        tilert_discovery=config.TileRTDiscovery(service="a.svc"),
    )
    data = yaml.safe_load(config.dump(plain))
    # What a router of the previous release reads: URLs, no compat key, one discovery mapping.
    assert data["prefill"] == ["http://p0"] and "compat" not in data["tilert"][0]
    assert data["tilert_discovery"]["service"] == "a.svc" and "compat" not in data["tilert_discovery"]
    assert yaml.safe_load(config.dump(config.RouterConfig(model="m", prefill=[])))["tilert_discovery"] is None
    gens = plain.model_copy(
        update={
            "prefill": [
                config.Endpoint(url="http://p0", compat="g1"),
                config.Endpoint(url="http://p1", compat="g2"),
            ],
            "tilert_discovery": [
                config.TileRTDiscovery(service="a", compat="g1"),
                config.TileRTDiscovery(service="b"),
            ],
        }
    )
    path = tmp_path / "config.yaml"
    for cfg in (plain, gens):
        path.write_text(config.dump(cfg))
        assert config.load(path) == cfg.model_copy(update={"tilert_discovery": cfg.discoveries()})
