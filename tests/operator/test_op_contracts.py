"""The rendered command lines parse with the components' own argument parsers: decode-node, router,
tiny-model, and (slow: imports vLLM) `vllm serve`, whose parser also builds the KVTransferConfig."""

from __future__ import annotations

import argparse
from typing import Any

import pdc_helpers as helpers
import pytest

from tilert_operator import constants
from tilert_operator import spec as specmod
from tilert_operator.render import commands
from tilert_serve import vllm_cpu

EXAMPLES = [p.stem for p in helpers.EXAMPLES]


def _cmds(example: str) -> dict[str, commands.ContainerCommand]:
    return commands.commands(specmod.parse(helpers.example(example)["spec"]))


def _parse(module: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("example", EXAMPLES)
def test_decode_node_parses_the_rendered_command(example: str) -> None:
    from tilert_serve.decode import cli

    cmd = _cmds(example)[constants.TILERT]
    args = _parse(cli, cmd.argv[2:])
    spec = specmod.parse(helpers.example(example)["spec"])
    assert (args.engine, args.slots, args.ctrl_port, args.http_port) == (
        spec.decode.tilert.engine,
        spec.decode.tilert.slots,
        spec.decode.tilert.ctrl_port,
        spec.decode.tilert.http_port,
    )


@pytest.mark.parametrize("example", EXAMPLES)
def test_router_and_tiny_model_parse_the_rendered_commands(example: str) -> None:
    from tilert_serve.router import cli as router_cli
    from tilert_serve.tinymodel import cli as tiny_cli

    cmds = _cmds(example)
    assert _parse(router_cli, cmds[constants.ROUTER].argv[2:]).config == "/etc/tilert-pd/router/config.yaml"
    if commands.TINY_MODEL in cmds:
        assert _parse(tiny_cli, cmds[commands.TINY_MODEL].argv[2:]).out == "/models"


@pytest.mark.slow
def test_vllm_serve_parses_the_rendered_commands() -> None:
    # Imported here (importing vLLM is slow) and never importorskip'd: make setup always installs vLLM,
    # so a vLLM that moved these must fail the contract, not skip it.
    from vllm.entrypoints.launchers import cli_args as vllm_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for example in EXAMPLES:
        cmds = _cmds(example)
        for comp in (constants.PREFILL, constants.NATIVE):
            if comp not in cmds:
                continue
            args = vllm_args.make_arg_parser(FlexibleArgumentParser()).parse_args(cmds[comp].argv[2:])
            kv = args.kv_transfer_config
            assert kv.kv_role == ("kv_producer" if comp == constants.PREFILL else "kv_consumer")
            # A pool without GPUs runs vLLM's CPU build: the drafter's attention backend is named too.
            spec = specmod.parse(helpers.example(example)["spec"])
            gpus = spec.prefill.gpus if comp == constants.PREFILL else spec.decode.native.gpus
            expected: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 1}
            if gpus == 0:
                expected["attention_backend"] = vllm_cpu.VLLM_CPU_ATTENTION_BACKEND
                assert args.attention_backend == vllm_cpu.VLLM_CPU_ATTENTION_BACKEND
                assert (
                    args.compilation_config.custom_ops == vllm_cpu.VLLM_CPU_COMPILATION_CONFIG["custom_ops"]
                )
            else:
                assert args.attention_backend is None
            assert args.speculative_config == expected


def _vllm_omp_binding(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, *, connector: bool, cpus: int = 2
) -> tuple[list[int], list[int]]:
    """(the CPUs vLLM's CPU build pins its worker's OpenMP threads to, those it leaves to the rest),
    as its executor computes them for one rank on a box of `cpus` single-thread cores."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.utils import ompmultiprocessing as omp

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build is not the installed one")
    for key in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    box = [omp.LogicalCPUInfo(i, i, 0) for i in range(cpus)]
    monkeypatch.setattr(omp.cr_utils, "get_allowed_cpu_list", lambda: box)
    monkeypatch.setattr(omp.cr_utils, "get_visible_memory_node", lambda: [0])
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            local_world_size=1, data_parallel_rank_local=None, _api_process_count=1
        ),
        kv_transfer_config=object() if connector else None,
    )
    manager = omp.OMPProcessManager(config)
    return manager.cpu_lists[0], manager.reserved_cpu_list


@pytest.mark.parametrize("example", EXAMPLES)
def test_cpu_vllm_pools_reserve_vllms_cores_for_no_connector(example: str) -> None:
    spec = specmod.parse(helpers.example(example)["spec"])
    cmds = _cmds(example)
    for comp, pool in ((constants.PREFILL, spec.prefill), (constants.NATIVE, spec.decode.native)):
        if comp not in cmds:
            continue
        reserved = cmds[comp].env.get(vllm_cpu.VLLM_CPU_RESERVED_CPU_ENV)
        assert reserved == (str(pool.tensor_parallel_size) if pool.gpus == 0 else None), (example, comp)


@pytest.mark.slow
def test_cpu_vllm_with_a_connector_keeps_a_core_beside_its_openmp_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native path's ~0.5 s per decode step on a 2-core box (vllm_cpu.py): with a connector, vLLM
    reserves two cores, finds only two, reserves none and spins an OpenMP thread on each."""
    # The premise, in vLLM's own code: a connector alone costs the engine core its reserved core.
    assert _vllm_omp_binding({}, monkeypatch, connector=True) == ([0, 1], [])
    assert _vllm_omp_binding({}, monkeypatch, connector=False) == ([0], [1])
    cmds = _cmds("tiny-cpu")
    for comp in (constants.PREFILL, constants.NATIVE):
        assert _vllm_omp_binding(cmds[comp].env, monkeypatch, connector=True) == ([0], [1]), comp
        # Larger boxes keep vLLM's own split less that one extra core.
        assert _vllm_omp_binding(cmds[comp].env, monkeypatch, connector=True, cpus=8) == (
            [0, 1, 2, 3, 4, 5, 6],
            [7],
        ), comp
