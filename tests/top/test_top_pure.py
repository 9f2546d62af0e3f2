"""`tilert-pd top`'s pure core: metrics text -> samples, two scrapes -> view (rates and percentiles
over the interval, not since start), view -> screen lines, and how the arguments name the sources.
The metrics texts are written by the components' own metric classes, so a renamed metric fails here."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from tilert_serve.decode.metrics import NodeMetrics
from tilert_serve.local import runner
from tilert_serve.router.metrics import Metrics
from tilert_serve.top import cli, samples, screen, sources, view
from tilert_serve.top.view import Scrape, Source

ROUTER = Source("router", "router", "http://127.0.0.1:8000")
NODE = Source("t0", "node", "http://127.0.0.1:5557")
NODE_DOWN = Source("t1", "node", "http://127.0.0.1:5558")


def scrape(source: Source, at: float, text: bytes | None, error: str | None = None) -> Scrape:
    return Scrape(source, at, samples.parse(text.decode()) if text is not None else None, error)


# --- samples -------------------------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (math.inf, 20.0)]
    assert samples.quantile(0.5, buckets) == pytest.approx(0.2)
    assert samples.quantile(0.25, buckets) == pytest.approx(0.15)
    assert samples.quantile(0.75, buckets) == pytest.approx(0.3)
    # Past the highest finite bound: that bound, as histogram_quantile answers.
    assert samples.quantile(0.99, [(1.0, 1.0), (math.inf, 100.0)]) == 1.0
    assert samples.quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert samples.quantile(0.5, []) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        samples.quantile(99, buckets)


def test_a_counter_that_went_down_was_reset_and_counts_from_zero():
    assert samples.increase(15.0, 10.0) == 5.0
    assert samples.increase(3.0, 10.0) == 3.0  # the process restarted
    assert samples.increase(4.0, None) == 4.0  # a series new since the last scrape
    assert samples.increase(None, 4.0) == 0.0


def test_percentiles_come_from_the_interval_not_from_since_start():
    m = Metrics()
    for _ in range(1000):
        m.ttft.labels("tilert").observe(50.0)  # a slow start, long ago
    before = samples.parse(m.render().decode())
    for _ in range(20):
        m.ttft.labels("tilert").observe(0.004)
    after = samples.parse(m.render().decode())
    buckets = samples.bucket_increases(after, before, "tilert_router_ttft_seconds", path="tilert")
    assert buckets[-1] == (math.inf, 20.0)
    p99 = samples.quantile(0.99, buckets)
    assert p99 is not None and 0.002 < p99 <= 0.005
    # Since start the p99 would be the slow one's bucket.
    since_start = samples.bucket_increases(after, None, "tilert_router_ttft_seconds", path="tilert")
    slow = samples.quantile(0.99, since_start)
    assert slow is not None and 30.0 < slow <= 60.0


def test_text_that_is_not_an_exposition_is_refused_by_name():
    with pytest.raises(ValueError, match="not Prometheus text"):
        samples.parse("<html>this is a login page</html>\n")


# --- view and screen -------------------------------------------------------------------------------


def _router_with_traffic(m: Metrics, ok: int, failed: int) -> None:
    for _ in range(ok):
        m.requests.labels("tilert", "ok").inc()
        m.ttft.labels("tilert").observe(0.03)
        m.itl.labels("tilert").observe(0.004)
    for _ in range(failed):
        m.requests.labels("tilert", "http_503").inc()
    m.requests.labels("native", "client_gone").inc()  # a client leaving is not the stack's error


def test_two_scrapes_give_rates_over_the_interval_and_the_pools_and_slots_now():
    m = Metrics()
    m.path_up.labels("tilert").set(1)
    m.path_up.labels("native").set(0)
    m.healthy.labels("prefill", "http://p0").set(1)
    m.healthy.labels("tilert", "http://t0").set(1)
    m.healthy.labels("tilert", "http://t1").set(0)
    m.endpoint_breaker_open.labels("tilert", "http://t1").set(1)
    m.upstream_errors.labels("tilert", "connect").inc(3)
    m.slots.labels("t0").set(2)
    m.slots.labels("t1").set(0)
    m.breaker_open.labels("t1").set(1)
    m.inflight.labels("tilert").set(2)
    _router_with_traffic(m, ok=100, failed=0)  # before the interval: not in the rates
    node = NodeMetrics(slots=4)
    node.handoffs.labels("complete").inc(10)
    node.handoff_bytes.inc(10_000_000)
    node.handoff_seconds.observe(0.5)
    first = [scrape(ROUTER, 10.0, m.render()), scrape(NODE, 10.0, node.render())]

    _router_with_traffic(m, ok=8, failed=2)
    m.upstream_errors.labels("tilert", "connect").inc(4)
    node.slots_busy.set(3)
    node.handoffs.labels("complete").inc(6)
    node.handoffs.labels("failed").inc(2)
    node.handoff_bytes.inc(6_000_000)
    for _ in range(6):
        node.handoff_seconds.observe(0.002)  # 12 ms moving 6 MB: 500 MB/s on the link
    node.tpot_seconds.observe(0.01)
    second = [
        scrape(ROUTER, 12.0, m.render()),
        scrape(NODE, 12.0, node.render()),
        scrape(NODE_DOWN, 12.0, None, "[Errno 111] Connection refused"),
    ]
    v = view.build(second, first)

    assert v.interval_s == 2.0
    routes = {r.route: r for r in v.routes}
    assert set(routes) == {"tilert", "native"}
    t = routes["tilert"]
    assert (t.up, t.requests_per_s, t.errors_per_s, t.inflight) == (1, 5.0, 1.0, 2)
    assert t.ttft_p50 is not None and 0.02 < t.ttft_p50 <= 0.05
    assert t.tpot_p50 is not None and 0.002 < t.tpot_p50 <= 0.005
    assert routes["native"].up == 0 and routes["native"].requests_per_s == 0.5
    assert routes["native"].errors_per_s == 0.0
    pools = {p.pool: p for p in v.pools}
    assert (pools["tilert"].healthy, pools["tilert"].endpoints, pools["tilert"].breakers_open) == (1, 2, 1)
    assert pools["tilert"].errors_per_s == 2.0
    assert (pools["prefill"].healthy, pools["prefill"].endpoints) == (1, 1)
    assert v.router_slots == (("t0", 2.0, False), ("t1", 0.0, True))
    n0, n1 = v.nodes
    assert (n0.slots_busy, n0.slots, n0.handoffs_per_s, n0.failed_per_s) == (3, 4, 4.0, 1.0)
    assert n0.received_bytes_per_s == 3_000_000
    assert n0.link_bytes_per_s == pytest.approx(500e6)
    assert n1.error == "[Errno 111] Connection refused" and n1.slots is None

    text = "\n".join(screen.lines(v, "12:00:00 UTC"))
    assert "rates over the last 2.0 s" in text
    assert _row(text, "tilert").split()[:5] == ["tilert", "up", "5.0", "1.0", "2"]
    assert _row(text, "native").split()[:4] == ["native", "DOWN", "0.5", "0.0"]
    assert _row(text, "t0").split()[:4] == ["t0", "3/4", "4.0", "1.0"]
    assert "3.0 MB/s" in _row(text, "t0") and "500.0 MB/s" in _row(text, "t0")
    assert _row(text, "t1").split(maxsplit=1) == ["t1", "DOWN: [Errno 111] Connection refused"]
    assert "router holds slots: t0 2  t1 0 (breaker open)" in text


def _row(text: str, first: str) -> str:
    return next(line for line in text.splitlines() if line.split()[:1] == [first])


def test_the_first_round_shows_gauges_and_no_rates():
    m = Metrics()
    m.path_up.labels("tilert").set(1)
    _router_with_traffic(m, ok=50, failed=5)
    v = view.build([scrape(ROUTER, 1.0, m.render())], None)
    (t,) = [r for r in v.routes if r.route == "tilert"]
    assert (t.requests_per_s, t.errors_per_s, v.interval_s) == (0.0, 0.0, 0.0)
    assert "no rates yet (they need two scrapes in a row)" in screen.lines(v, "x")[0]


def test_a_router_that_does_not_answer_shows_down_with_its_error():
    v = view.build(
        [scrape(ROUTER, 2.0, None, "HTTP 401 Unauthorized (give a key with --api-key-file)")], None
    )
    text = "\n".join(screen.lines(v, "x"))
    assert "router DOWN: HTTP 401 Unauthorized (give a key with --api-key-file)" in text
    assert v.routes == () and v.pools == ()


def test_figures_are_shown_in_short_units():
    assert [screen.seconds(x) for x in (None, 0.00085, 0.0123, 1.5)] == ["-", "850 us", "12.3 ms", "1.50 s"]
    assert [screen.byte_rate(x) for x in (None, 0, 12_300, 4.56e9)] == [
        "-",
        "0 B/s",
        "12.3 kB/s",
        "4.56 GB/s",
    ]


# --- sources -------------------------------------------------------------------------------------


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_a_local_stacks_sources_come_from_its_recorded_state(tmp_path: Path):
    tmp_path.chmod(0o700)
    state = tmp_path / "tiny"
    state.mkdir(mode=0o700)
    runner.write_secrets(state)

    def rec(name: str, kind: str, url: str) -> runner.Running:
        return runner.Running(name=name, kind=kind, pid=1, url=url, ready_url=url + "/ready", log="x")

    runner.save(
        state,
        {"cluster": "tiny", "router": "http://127.0.0.1:8000"},
        [
            rec("prefill-0", "prefill", "http://127.0.0.1:20001"),
            rec("tilert-0", "tilert-decode", "http://127.0.0.1:20002/"),
            rec("router", "router", "http://127.0.0.1:8000"),
        ],
    )
    targets = cli.targets(_args(home=tmp_path))
    assert [(t.source.name, t.source.kind, t.source.url) for t in targets] == [
        ("router", "router", "http://127.0.0.1:8000"),
        ("tilert-0", "node", "http://127.0.0.1:20002"),
    ]
    token = (state / runner.NODE_API_TOKEN_FILE).read_text().strip()
    assert targets[1].token is not None and targets[1].token.first() == token
    assert targets[0].token is None  # the local router has no API keys

    (tmp_path / "other").mkdir(mode=0o700)
    runner.save(tmp_path / "other", {"cluster": "other", "router": "http://127.0.0.1:9000"}, [])
    with pytest.raises(ValueError, match=r"2 local stacks .* pick one with --name"):
        cli.targets(_args(home=tmp_path))
    assert cli.targets(_args(home=tmp_path, name="other"))[0].source.url == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="no local stack named 'gone'"):
        cli.targets(_args(home=tmp_path, name="gone"))
    state.chmod(0o777)  # another user could point the node token elsewhere
    with pytest.raises(ValueError, match="writable by group and others"):
        cli.targets(_args(home=tmp_path, name="tiny"))


def test_bad_arguments_say_what_to_fix(tmp_path: Path):
    with pytest.raises(ValueError, match=r"--node 'localhost:5557' is not an http\(s\) URL"):
        cli.targets(_args(router="http://127.0.0.1:8000", node=["localhost:5557"]))
    with pytest.raises(ValueError, match="--node '=http://x' has an empty name"):
        cli.targets(_args(router="http://127.0.0.1:8000", node=["=http://x"]))
    named = cli.targets(_args(router="http://r:1/", node=["t0=http://127.0.0.1:5557", "http://n:2"]))
    assert [(t.source.name, t.source.url) for t in named] == [
        ("router", "http://r:1"),
        ("t0", "http://127.0.0.1:5557"),
        ("n:2", "http://n:2"),
    ]
    with pytest.raises(ValueError, match="not both"):
        cli.targets(_args(router="http://127.0.0.1:8000", home=tmp_path))
    with pytest.raises(ValueError, match="--node and --token-file go with --router"):
        cli.targets(_args(node=["http://127.0.0.1:5557"]))
    with pytest.raises(ValueError, match="--token-file: cannot read the token file"):
        cli.targets(_args(router="http://127.0.0.1:8000", token_file=tmp_path / "missing"))
    with pytest.raises(ValueError, match="above 0"):
        cli.targets(_args(router="http://127.0.0.1:8000", interval=0.0))


def test_once_prints_one_screen_with_the_sources_down_and_exits_0(capsys: pytest.CaptureFixture[str]):
    from tilert_serve.cli import main

    assert (
        main(
            [
                "top",
                "--once",
                "--interval",
                "0.05",
                "--router",
                "http://127.0.0.1:1",
                "--node",
                "t9=http://127.0.0.1:2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tilert-pd top  http://127.0.0.1:1  no rates yet")
    assert "router DOWN: [Errno 111] Connection refused" in out
    assert any(line.split()[:2] == ["t9", "DOWN:"] for line in out), out
    assert main(["top", "--router", "localhost:8000"]) == 2
    assert "--router 'localhost:8000' is not an http(s) URL" in capsys.readouterr().err


def test_a_source_that_refuses_is_a_scrape_with_its_error():
    s = sources.scrape(sources.Target(Source("r", "router", "http://127.0.0.1:1")), timeout_s=2.0)
    assert s.samples is None and s.error is not None and "refused" in s.error.lower()
