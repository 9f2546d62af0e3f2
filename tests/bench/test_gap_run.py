"""The gap benchmark's pure helpers (bench/gap/run.py): how it turns the overlap on in a rendered
prefill command, and how it reads the node's timings. The benchmark itself is not run by the tests."""

from __future__ import annotations

import json

from bench.gap import run

ARGV = [
    "python",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--kv-transfer-config",
    json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "TileRTConnector", "kv_connector_extra_config": {"tilert_model": "mla"}},
                    {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
                ]
            },
        }
    ),
    "--enforce-eager",
]


def test_the_key_goes_to_the_tilert_connector_only() -> None:
    out = run.with_connector_key(ARGV, run.KEY, True)
    assert out[:4] == ARGV[:4] and out[5:] == ARGV[5:]
    conns = json.loads(out[4])["kv_connector_extra_config"]["connectors"]
    assert conns[0]["kv_connector_extra_config"] == {"tilert_model": "mla", run.KEY: True}
    assert "kv_connector_extra_config" not in conns[1]


def test_a_lone_tilert_connector_gets_the_key_too() -> None:
    argv = [
        "x",
        "--kv-transfer-config",
        json.dumps({"kv_connector": "TileRTConnector", "kv_role": "kv_producer"}),
    ]
    assert json.loads(run.with_connector_key(argv, run.KEY, False)[2])["kv_connector_extra_config"] == {
        run.KEY: False
    }


def test_stage_columns_follow_the_node_and_keep_counts_apart() -> None:
    node = {
        "wire_wait_ms": 1.0,
        "digest_ms": 1.0,
        "convert_ms": 1.0,
        "inject_ms": 1.0,
        "decode_ms": 1.0,
        "tpot_ms": 1.0,
        "mtp_acceptance": 0.5,
        "hidden_convert_ms": 2.0,
        "layers_layerwise": 3.0,
    }
    batches = {
        (16, "serial"): run.Batch(
            [run.Sample(10.0, node, 5.0)], {"extract_ms": 1.0, "send_ms": 2.0, "bytes": 1e5}
        )
    }
    ms, info = run.stage_keys(batches)
    assert ms == [*run.NODE_KEYS, "hidden_convert_ms"]
    assert info == ["layers_layerwise"]
    s = run.summarize(batches[(16, "serial")], ms + info)
    # After the answer: what of the gap the node's own stages do not explain.
    assert s["after_answer"] == 10.0 - 4.0
    assert s["critical"] == 1.0 + 10.0


def test_nearest_rank_percentile() -> None:
    xs = [float(x) for x in range(1, 11)]
    assert run.pct(xs, 90) == 9.0
    assert run.pct(xs, 100) == 10.0
    assert run.pct([3.0], 90) == 3.0
