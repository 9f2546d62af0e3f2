"""The connector's loggers: children of vLLM's `vllm` logger, so its lines appear in vLLM's output.

vLLM configures one handler, on the `vllm` logger, with propagate off, and leaves the root logger
bare. A logger named after our package (`tilert_serve.pd_vllm.worker`) would reach only the root, where
info lines are dropped and warnings lose vLLM's format; under `vllm.` they share vLLM's handler,
format and VLLM_LOGGING_LEVEL, and get its `info_once`/`warning_once`.
"""

from __future__ import annotations

from vllm.logger import _VllmLogger, init_logger

PREFIX = "vllm."


def get_logger(module: str) -> _VllmLogger:
    return init_logger(PREFIX + module)
