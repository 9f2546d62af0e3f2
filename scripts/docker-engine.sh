#!/usr/bin/env bash
# Makes sure a Docker engine answers (`docker info`). Idempotent: when one answers, it returns at once.
# When none does and we are root: installs docker.io with apt if dockerd is missing, starts
#   dockerd --iptables=false --bridge=none
# in the background (log: $DOCKERD_LOG, default /var/log/tilert-pd-dockerd.log) and waits until it
# answers (at most $DOCKERD_WAIT_S seconds, default 60). Otherwise it says why and exits non-zero.
#
# --bridge=none / --iptables=false: the engine works on machines whose kernel or policy forbids
# iptables changes; builds and containers then use `--network host` or user-defined bridge networks
# (see docker/README.md).
set -euo pipefail

log=${DOCKERD_LOG:-/var/log/tilert-pd-dockerd.log}
wait_s=${DOCKERD_WAIT_S:-60}

say() { printf '==> docker-engine: %s\n' "$*"; }
die() { printf 'docker-engine: %s\n' "$*" >&2; exit 1; }
answers() { timeout 10 docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && answers; then
  say "engine answers ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  die "no Docker engine answers and we are not root: start one (e.g. 'sudo dockerd --iptables=false --bridge=none &'), or add this user to the docker group"
fi

if ! command -v dockerd >/dev/null 2>&1; then
  say "installing docker.io (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi
command -v docker >/dev/null 2>&1 || die "dockerd is installed but no 'docker' client is on PATH"

if pgrep -x dockerd >/dev/null 2>&1; then
  say "dockerd is running but does not answer yet; waiting"
else
  say "starting dockerd --iptables=false --bridge=none (log: $log)"
  mkdir -p "$(dirname "$log")"
  nohup dockerd --iptables=false --bridge=none >>"$log" 2>&1 </dev/null &
  disown || true
fi

deadline=$((SECONDS + wait_s))
until answers; do
  if [ $SECONDS -ge $deadline ]; then
    tail -n 20 "$log" >&2 2>/dev/null || true
    die "the Docker engine did not answer within ${wait_s}s (log: $log)"
  fi
  sleep 1
done
say "engine answers ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
