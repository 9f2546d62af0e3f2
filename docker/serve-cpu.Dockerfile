# ghcr.io/tilert-pd/serve:0.1.0-cpu: the router and the decode node on CPUs (reference engine,
# Mooncake over TCP): the tiny stack in examples/tiny-cpu.yaml, e.g. on kind.
#   docker build -f docker/serve-cpu.Dockerfile -t ghcr.io/tilert-pd/serve:0.1.0-cpu .
#
# Python 3.11 and the wheels of constraints.txt are exactly what `make setup` installs and the test
# suite runs on the CPU machines (the non-CUDA Mooncake wheel was verified as cp311). Base pinned to
# a patch tag so rebuilds are reproducible; bumping it is a reviewed change.
ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Mooncake's non-CUDA wheel links these; --no-install-recommends keeps ibverbs-providers out (its
# libefa makes NIXL's bundled UCX crash at exit; see scripts/setup.sh). No RDMA device is needed: TCP.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Dependencies first, from pyproject.toml alone (no packages yet: this installs only the
# requirements), so editing the source does not reinstall torch.
# README.md is pyproject's `readme`: an empty stand-in here, so editing the README does not
# reinstall the dependencies (the real one comes with the source below).
COPY pyproject.toml constraints.txt ./
# Where torch's CPU wheels come from: constraints.txt pins torch==2.13.0+cpu, which is on PyTorch's
# index, not on PyPI. Build arguments, not ENV, so the image does not carry them. Where that index is
# unreachable, scripts/images.sh empties PIP_EXTRA_INDEX_URL and serves a wheelhouse made by the host's
# pip on 127.0.0.1 as PIP_FIND_LINKS (the build runs with --network host; no wheel enters a layer).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
RUN touch README.md \
 && pip install -c constraints.txt ".[decode,router,tinymodel,transfer]" \
 && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1

COPY README.md ./
COPY tilert_serve ./tilert_serve
COPY operator ./operator
RUN pip install --no-deps --force-reinstall . \
 && cd / && rm -rf /src \
 && python -c "import torch, mooncake.engine, nixl, tilert_serve.decode.cli, tilert_serve.router.cli"

# The non-root user the pods run as (tilert_operator.constants.RUN_AS_USER; render/hygiene.py), with a
# passwd entry (torch's compile cache and getpass.getuser() look the uid up) and a HOME any uid can
# write its caches to (vLLM, Triton, Hugging Face), for runtimes that pick another uid.
RUN echo 'tilert:x:65532:65532:tilert-pd:/home/tilert:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'tilert:x:65532:' >>/etc/group \
 && install -d -m 1777 /home/tilert
ENV HOME=/home/tilert
USER 65532:65532

WORKDIR /tmp
# The operator sets the command (`tilert-pd decode-node ...` or `tilert-pd router ...`).
ENTRYPOINT ["tilert-pd"]
CMD ["--help"]
