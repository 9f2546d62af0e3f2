#!/usr/bin/env bash
# Everything bench/ runs on a GPU, in one go (a borrowed machine is held by the minute): the gpu-marked
# tests of the Triton kernels, then extract, convert, the GPU digest and the reference engine on CUDA. RESULTS.md
# sections are written into $OUT/RESULTS.md (the machine has no git checkout: BENCH_COMMIT names the
# commit that was sent); back here, `python -m bench.common merge <that file>` carries them over.
#
#   BENCH_COMMIT=$(git rev-parse --short HEAD) OUT=/some/dir [BENCH_TUNE=1] [BENCH_EXPLORE=1] bash bench/gpu.sh
# (BENCH_TUNE=1: extract and convert also time their kernel variants, into the notes under their tables)
# The machine has no pydantic, which the layer-wise CUDA test's worker and the decode node (the settle
# test) need: carry its wheels in .whl
# (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .whl pydantic pydantic_core annotated-types typing-inspection, versions as in
# the venv); they are installed into /tmp/site here. Without them the layer-wise test is skipped and the
# settle test fails to import (tests/decode/conftest.py and decode/node.py import pydantic).
set -u
: "${OUT:?set OUT to a folder for the logs and RESULTS.md}"
export PYTHONUNBUFFERED=1 BENCH_RESULTS="$OUT/RESULTS.md"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
cp bench/RESULTS.md "$OUT/RESULTS.md"
nvidia-smi -L
echo "pytest start $(date -u +%FT%TZ)"
timeout 300 "$PY" -m pytest -m gpu tests/layouts/test_convert_triton.py tests/pd_vllm/test_extract_triton.py \
  tests/pd_vllm/test_layerwise_cuda.py tests/decode/test_settle_cuda.py tests/decode/test_snapshot_cuda.py \
  tests/handoff/test_digest_gpu.py -v \
  -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc $? end $(date -u +%FT%TZ)"
timeout 150 "$PY" -m bench.extract.run ${BENCH_TUNE:+--tune} >"$OUT/extract.log" 2>&1; echo "extract rc $?"
timeout 240 "$PY" -m bench.convert.run ${BENCH_TUNE:+--tune} >"$OUT/convert.log" 2>&1; echo "convert rc $?"
timeout 300 "$PY" -m bench.digest.gpu ${BENCH_TUNE:+--tune} >"$OUT/digest_gpu.log" 2>&1; echo "digest gpu rc $?"
{ "$PY" -m tilert_serve.cli tiny-model --out /tmp/tiny-bench &&
  timeout 120 "$PY" -m bench.engine.run --model /tmp/tiny-bench --device cuda; } >"$OUT/engine.log" 2>&1
echo "engine rc $?"
# BENCH_EXPLORE=1: issue 14's kernel experiments (floors, write-heavy ceiling, tile variants, launch cost).
if [ -n "${BENCH_EXPLORE:-}" ]; then
  timeout 300 "$PY" -m bench.convert.explore >"$OUT/explore.log" 2>&1; echo "explore rc $?"
fi
tail -n 3 "$OUT/pytest.log"
