# ghcr.io/tilert-pd/serve:0.1.0-cuda: the router and the TileRT decode node on GPUs. It holds TileRT as
# its README requires: Python 3.12 (the `tilert` wheels are cp312-only), torch==2.11.0+cu130,
# transformers 4.46.3, tokenizers 0.20.3; and the CUDA builds of the transfer engines.
#   docker build -f docker/serve-cuda.Dockerfile -t ghcr.io/tilert-pd/serve:0.1.0-cuda .
# TileRT's kernels run on Blackwell (sm_100) only and want a host driver that supports CUDA 13.2; on
# other GPUs this image runs the reference engine (spec.decode.tilert.engine: reference).
#
# Base: CUDA 13.0 runtime to match torch's cu130 build, on Ubuntu 24.04, whose python3 is 3.12.
# Pinned to a patch tag so that rebuilds are reproducible; bumping it is a reviewed change.
ARG BASE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
FROM ${BASE}

ARG TORCH_VERSION=2.11.0
ARG TILERT_VERSION=0.1.6.post3
# Mooncake's CUDA 13 build (the plain package is built for CUDA <= 12.9); NIXL's cu13 build,
# installed without its dependencies (they would pull a second torch).
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine-cuda13==0.3.13.post1
ARG NIXL_PACKAGES="nixl==1.5.1 nixl-cu13==1.5.1"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# ibverbs-providers: the RDMA NIC drivers (mlx5, ...) that Mooncake and UCX load at run time.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3.12 python3.12-venv libibverbs1 ibverbs-providers libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv

# The stack TileRT's README names, first and on its own: later installs see torch as satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cu130 "torch==${TORCH_VERSION}" \
 && pip install "tilert==${TILERT_VERSION}" "transformers==4.46.3" "tokenizers==0.20.3" \
 && pip install "${MOONCAKE_PACKAGE}" \
 && pip install --no-deps ${NIXL_PACKAGES}

WORKDIR /src
# Dependencies from pyproject.toml (no packages copied yet), then the source: editing the source does
# not reinstall anything heavy.
# README.md is pyproject's `readme`: an empty stand-in here, so editing the README does not
# reinstall the dependencies (the real one comes with the source below).
COPY pyproject.toml ./
RUN touch README.md \
 && pip install ".[decode,router]"
COPY README.md ./
COPY tilert_serve ./tilert_serve
COPY operator ./operator
# The check imports no CUDA code: the build machine has no GPU (tilert and mooncake load it lazily).
RUN pip install --no-deps --force-reinstall . \
 && cd / && rm -rf /src \
 && python -c "import torch, tilert, tilert_serve.decode.cli, tilert_serve.router.cli; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# The non-root user the pods run as (tilert_operator.constants.RUN_AS_USER; render/hygiene.py), with a
# passwd entry (torch's compile cache and getpass.getuser() look the uid up) and a HOME any uid can
# write its caches to (vLLM, Triton, Hugging Face), for runtimes that pick another uid.
RUN echo 'tilert:x:65532:65532:tilert-pd:/home/tilert:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'tilert:x:65532:' >>/etc/group \
 && install -d -m 1777 /home/tilert
ENV HOME=/home/tilert
USER 65532:65532

WORKDIR /tmp
ENTRYPOINT ["tilert-pd"]
CMD ["--help"]
