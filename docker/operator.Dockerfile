# ghcr.io/tilert-pd/operator: the PDCluster operator (`tilert-pd operator`), what the chart deploys.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/tilert-pd/operator:0.1.0 .
#
# Base pinned to a patch tag, not `3.12-slim`: a rebuild gets the same interpreter, and a base
# update is a reviewed one-line change. Python 3.12 is what the serving images use too.
ARG BASE=python:3.12.12-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The operator imports neither torch nor transformers (tilert_operator renders manifests and talks to
# the API): pyproject.toml's base dependencies and its `operator` extra are all it installs, from
# pyproject.toml alone first (no packages yet), so editing the source does not reinstall them.
WORKDIR /src
# README.md is pyproject's `readme`: an empty stand-in here, so editing the README does not
# reinstall the dependencies (the real one comes with the source below).
COPY pyproject.toml ./
RUN touch README.md \
 && pip install ".[operator]"

COPY README.md ./
COPY tilert_serve ./tilert_serve
COPY operator ./operator
RUN pip install --no-deps --force-reinstall . \
 && cd / && rm -rf /src \
 && python -c "import tilert_operator.cli_operator, tilert_operator.wiring" \
 && tilert-pd operator --help >/dev/null

# A numeric non-root user, so the chart's runAsNonRoot/runAsUser 65532 can be verified by the kubelet.
# It needs a passwd entry: kopf names the operator's identity after getpass.getuser(), which fails with
# "getpwuid(): uid not found" for a uid the image does not know (found by running this image).
RUN echo 'nonroot:x:65532:65532:tilert-pd operator:/home/nonroot:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'nonroot:x:65532:' >>/etc/group \
 && install -d -o 65532 -g 65532 /home/nonroot
USER 65532:65532
WORKDIR /tmp
# Liveness (kopf /healthz), metrics (/metrics), admission webhook (when the chart enables it).
EXPOSE 8081 8080 9443
CMD ["tilert-pd", "operator"]
