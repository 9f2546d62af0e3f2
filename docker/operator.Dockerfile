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
COPY pyproject.toml README.md ./
RUN pip install ".[operator]"

COPY tilert_serve ./tilert_serve
COPY operator ./operator
RUN pip install --no-deps --force-reinstall . \
 && cd / && rm -rf /src \
 && python -c "import tilert_operator.cli_operator, tilert_operator.wiring" \
 && tilert-pd operator --help >/dev/null

# A numeric non-root user, so the chart's runAsNonRoot/runAsUser 65532 can be verified by the kubelet.
USER 65532:65532
WORKDIR /tmp
# Liveness (kopf /healthz), metrics (/metrics), admission webhook (when the chart enables it).
EXPOSE 8081 8080 9443
CMD ["tilert-pd", "operator"]
