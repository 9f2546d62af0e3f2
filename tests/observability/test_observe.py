"""tilert_serve.observe: the Prometheus configuration it renders (promtool accepts it), the errors it
gives for bad targets, credentials kept private, and a Prometheus that refuses to start reported
with its own words."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from tests.observability.conftest import promtool
from tilert_operator import constants
from tilert_serve import observe
from tilert_serve.observe import config


def test_targets_are_checked() -> None:
    with pytest.raises(observe.ConfigError, match="job 'decode' is not one of router, tilert-decode"):
        observe.Target("decode", "127.0.0.1:5557")
    for bad in ("127.0.0.1", ":80", "host:http", "host:70000"):
        with pytest.raises(observe.ConfigError, match="give host:port"):
            observe.Target("router", bad)
    with pytest.raises(observe.ConfigError, match="must start with /"):
        observe.Target("router", "127.0.0.1:8000", path="metrics")
    with pytest.raises(observe.ConfigError, match=r"0\.1 to 300 seconds"):
        observe.Intervals(scrape_s=0)


def test_render_groups_by_job_with_one_credential(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    targets = [
        observe.Target("router", "127.0.0.1:8000", token_file=keys),
        observe.Target("tilert-decode", "127.0.0.1:5557"),
        observe.Target("tilert-decode", "127.0.0.1:5558", labels={"node": "b"}),
    ]
    token = tmp_path / "router-token"
    got = config.render(targets, {"router": token}, [tmp_path / "r.yaml"], observe.Intervals(0.5, 2))
    assert got["global"] == {
        "scrape_interval": "500ms",
        "scrape_timeout": "500ms",
        "evaluation_interval": "2000ms",
    }
    router, decode = got["scrape_configs"]
    assert router["job_name"] == "router"
    assert router["authorization"] == {"type": "Bearer", "credentials_file": str(token)}
    assert "authorization" not in decode
    assert decode["static_configs"] == [
        {"targets": ["127.0.0.1:5557"], "labels": {"pdcluster": "local"}},
        {"targets": ["127.0.0.1:5558"], "labels": {"pdcluster": "local", "node": "b"}},
    ]
    mixed = [*targets, observe.Target("tilert-decode", "127.0.0.1:5559", token_file=keys)]
    with pytest.raises(observe.ConfigError, match="job tilert-decode: its targets differ in token file"):
        config.render(mixed, {"router": token, "tilert-decode": token}, [])
    with pytest.raises(observe.ConfigError, match="no targets"):
        config.render([], {}, [])


def test_start_writes_private_files_promtool_accepts_then_stop(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# scrape key first\n\nthe-scrape-key\nanother-key\n")
    handle = observe.start(
        tmp_path / "state",
        [
            observe.Target("router", "127.0.0.1:9", token_file=keys),
            observe.Target("tilert-decode", "127.0.0.1:9"),
        ],
        intervals=observe.Intervals(1, 1),
    )
    try:
        assert handle.url.startswith("http://127.0.0.1:")
        token = handle.directory / "tokens" / "router"
        assert token.read_text() == "the-scrape-key"
        for private in (token, handle.password_file):
            assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
        assert stat.S_IMODE(handle.directory.stat().st_mode) == 0o700
        web = yaml.safe_load((handle.directory / "web.yml").read_text())
        hashed = web["basic_auth_users"][handle.username]
        assert hashed.startswith("$2") and handle.password_file.read_text() not in hashed
        done = promtool("check", "config", str(handle.config_file))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        observe.stop(handle)
    assert handle.process.returncode == 0
    observe.stop(handle)  # a second stop is a no-op


def test_a_prometheus_that_will_not_start_is_reported_with_its_log(tmp_path: Path) -> None:
    bad = tmp_path / "bad-rules.yaml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - record: a:b\n        expr: sum(\n")
    with pytest.raises(
        observe.ObserveError, match=r"prometheus exited with status \d+; its log .* ends:\n"
    ) as err:
        observe.start(tmp_path / "state", [observe.Target("router", "127.0.0.1:9")], rules=[bad])
    assert "bad-rules.yaml" in str(err.value)


def test_credential_problems_name_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(observe.ObserveError, match="holds no token"):
        observe.start(tmp_path / "s", [observe.Target("router", "127.0.0.1:9", token_file=empty)])
    with pytest.raises(observe.ObserveError, match="give a readable file"):
        observe.start(
            tmp_path / "s", [observe.Target("router", "127.0.0.1:9", token_file=tmp_path / "missing")]
        )
    with pytest.raises(observe.ObserveError, match=r"rule file .* does not exist"):
        observe.start(
            tmp_path / "s", [observe.Target("router", "127.0.0.1:9")], rules=[tmp_path / "none.yaml"]
        )


def test_local_target_from_a_local_components_kind_and_url() -> None:
    assert observe.local_target("tilert", "http://127.0.0.1:5557") == observe.Target(
        "tilert-decode", "127.0.0.1:5557"
    )
    assert observe.local_target("native", "http://127.0.0.1:8101/").job == "native-decode"
    # The local plan's kinds are the operator's component names.
    for kind in constants.COMPONENTS:
        assert observe.local_target(kind, "http://127.0.0.1:1").job == kind
    with pytest.raises(observe.ConfigError, match="kind 'decode' is not one of router, tilert-decode"):
        observe.local_target("decode", "http://127.0.0.1:5557")
    with pytest.raises(observe.ConfigError, match="give http://host:port"):
        observe.local_target("router", "127.0.0.1:8000")
