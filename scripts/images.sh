#!/usr/bin/env bash
# make images: builds the operator image and the two CPU images (docker/images.txt, "built-here: yes")
# with the legacy builder and `--network host` (see docker/README.md).
#
#   scripts/images.sh                    # all three
#   scripts/images.sh operator serve-cpu # some (Dockerfile names without .Dockerfile)
#
# Bases: each Dockerfile's `ARG BASE=` default (a pinned public image) when it is present or can be
# pulled within $PULL_TIMEOUT_S; otherwise the offline base docker/offline-base.sh makes from Debian's
# mirror (cached by a hash of its inputs). TILERT_PD_BASE=public|offline forces one (default auto).
# torch's CPU wheels: from PyTorch's CPU index when it answers; otherwise the host's pip downloads the
# pins of constraints.txt that are not on PyPI (local versions, `+cpu`) into docker/.wheelhouse, served
# to the build on 127.0.0.1:$WHEELHOUSE_PORT (no wheel enters a layer).
# IMAGES_NO_CACHE=1 builds without the layer cache (a cold build); IMAGES_SUMMARY_JSON=FILE appends one
# JSON line per image (tag, base, seconds, size_bytes, steps, cached_steps). Logs: $IMAGES_LOG_DIR.
# Unchanged inputs make a second run fast: every step comes from the layer cache.
set -euo pipefail
cd "$(dirname "$0")/.."

pull_timeout=${PULL_TIMEOUT_S:-30}
base_mode=${TILERT_PD_BASE:-auto}
port=${WHEELHOUSE_PORT:-38471}
wheelhouse=docker/.wheelhouse
log_dir=${IMAGES_LOG_DIR:-${TMPDIR:-/tmp}/tilert-pd-images}
torch_index=https://download.pytorch.org/whl/cpu
t0=$SECONDS

say() { printf '==> [%4ds] %s\n' "$((SECONDS - t0))" "$*"; }
die() { printf 'images: %s\n' "$*" >&2; exit 1; }

bash scripts/docker-engine.sh

# One build at a time on this machine (two test sessions, a benchmark): a second run waits, then finds
# every layer cached, instead of building the same images beside the first.
mkdir -p "$log_dir"
exec 9>"$log_dir/.lock"
if ! flock -n 9; then
  say "another scripts/images.sh is building; waiting for it"
  flock 9
fi

# --- what to build ---------------------------------------------------------------------------------
declare -A tag_of=()
all=()
while read -r df tag here; do
  case "$df" in ''|'#'*) continue ;; esac
  name=${df%.Dockerfile}
  tag_of[$name]=$tag
  [ "$here" = yes ] && all+=("$name")
done <docker/images.txt
if [ $# -gt 0 ]; then
  wanted=()
  for arg in "$@"; do
    name=${arg%.Dockerfile}; name=${name#docker/}
    [ -n "${tag_of[$name]:-}" ] || die "unknown image '$arg' (docker/images.txt: ${!tag_of[*]})"
    wanted+=("$name")
  done
else
  wanted=("${all[@]}")
fi

# --- bases -----------------------------------------------------------------------------------------
declare -A base_for=()
offline_base=""
resolve_base() {  # $1: the Dockerfile's default base -> sets $base
  local default=$1
  if [ -n "${base_for[$default]:-}" ]; then base=${base_for[$default]}; return; fi
  if [ "$base_mode" != offline ]; then
    if docker image inspect "$default" >/dev/null 2>&1; then
      base=$default
    else
      say "pulling $default (at most ${pull_timeout}s)"
      if timeout "$pull_timeout" docker pull -q "$default" >/dev/null 2>&1; then
        base=$default
      elif [ "$base_mode" = public ]; then
        die "cannot pull $default (TILERT_PD_BASE=public)"
      else
        say "cannot pull $default: using the offline base (Debian bookworm from the apt mirror)"
        base=""
      fi
    fi
  else
    base=""
  fi
  if [ -z "$base" ]; then
    [ -n "$offline_base" ] || offline_base=$(bash docker/offline-base.sh)
    base=$offline_base
  fi
  base_for[$default]=$base
}

# --- torch's wheels --------------------------------------------------------------------------------
index_args=()
server_pid=""
cleanup() { [ -z "$server_pid" ] || kill "$server_pid" 2>/dev/null || true; }
trap cleanup EXIT
needs_torch=0
for name in "${wanted[@]}"; do grep -q '^ARG PIP_FIND_LINKS' "docker/$name.Dockerfile" && needs_torch=1; done
reachable() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=8)' "$1" >/dev/null 2>&1; }
if [ $needs_torch = 1 ] && ! reachable "$torch_index/torch/"; then
  mkdir -p "$wheelhouse"
  # The pins PyPI does not have: local versions such as torch==2.13.0+cpu.
  mapfile -t pins < <(sed -n 's/^\([A-Za-z0-9_.-]\+==[^[:space:]#]*+[^[:space:]#]*\).*/\1/p' constraints.txt)
  for pin in "${pins[@]}"; do
    pkg=${pin%%==*}; ver=${pin#*==}
    if compgen -G "$wheelhouse/${pkg//-/_}-${ver}-*.whl" >/dev/null; then continue; fi
    say "PyTorch's index does not answer: the host's pip downloads $pin into $wheelhouse"
    ${HOST_PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$wheelhouse" "$pin" || die "the host's pip cannot download $pin (PyTorch's index is unreachable and no find-links has it)"
  done
  # A fixed port: the URL is a build argument, so another port misses the dependency layers' cache.
  for p in $(seq "$port" $((port + 20))); do
    python3 -c 'import socket, sys; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$p" 2>/dev/null && { port=$p; break; }
  done
  # 9>&-: the server does not hold the lock, should this script be killed without its EXIT trap.
  python3 -m http.server --bind 127.0.0.1 --directory "$wheelhouse" "$port" >/dev/null 2>&1 9>&- &
  server_pid=$!
  for _ in $(seq 50); do reachable "http://127.0.0.1:$port/" && break; sleep 0.1; done
  reachable "http://127.0.0.1:$port/" || die "the wheelhouse server on 127.0.0.1:$port did not start"
  say "wheelhouse $wheelhouse served on 127.0.0.1:$port ($(ls "$wheelhouse" | tr '\n' ' '))"
  index_args=(--build-arg PIP_EXTRA_INDEX_URL= --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
fi

# --- build -----------------------------------------------------------------------------------------
mkdir -p "$log_dir"
no_cache=(); [ "${IMAGES_NO_CACHE:-0}" = 1 ] && no_cache=(--no-cache)
summary=()
for name in "${wanted[@]}"; do
  df=docker/$name.Dockerfile tag=${tag_of[$name]}
  default=$(sed -n 's/^ARG BASE=//p' "$df" | head -n1)
  [ -n "$default" ] || die "$df has no 'ARG BASE=' line"
  resolve_base "$default"
  log=$log_dir/$name.log
  say "building $tag from $df on $base (log: $log)"
  start=$SECONDS
  # The image the tag names now: replaced by a changed build, it would stay behind untagged with its
  # layers (~2-4 GB a CPU image; repeated rebuilds filled a 100 GB disk), so it is removed below.
  old_id=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  set +e
  DOCKER_BUILDKIT=0 docker build --network host -f "$df" -t "$tag" --build-arg "BASE=$base" \
      "${index_args[@]}" "${no_cache[@]}" . 2>&1 | tee "$log" | while IFS= read -r line; do
    case "$line" in
      Step\ *) printf '    [%4ds] %s: %.110s\n' "$((SECONDS - start))" "$name" "$line" ;;
    esac
  done
  rc=${PIPESTATUS[0]}
  set -e
  secs=$((SECONDS - start))
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log" >&2
    die "building $tag failed after ${secs}s (exit $rc; full log: $log)"
  fi
  new_id=$(docker image inspect -f '{{.Id}}' "$tag")
  if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    docker rmi "$old_id" >/dev/null 2>&1 || true  # still used by a container: left alone
  fi
  steps=$(grep -c '^Step ' "$log" || true)
  cached=$(grep -c 'Using cache' "$log" || true)
  size=$(docker image inspect -f '{{.Size}}' "$tag")
  say "built $tag in ${secs}s ($cached of $steps steps cached), $((size / 1000000)) MB"
  summary+=("$(printf '%-44s %6d MB %6ds  %2d/%-2d  %s' "$tag" $((size / 1000000)) "$secs" "$cached" "$steps" "$base")")
  if [ -n "${IMAGES_SUMMARY_JSON:-}" ]; then
    printf '{"name": "%s", "tag": "%s", "base": "%s", "seconds": %d, "size_bytes": %d, "steps": %d, "cached_steps": %d, "no_cache": %s}\n' \
      "$name" "$tag" "$base" "$secs" "$size" "$steps" "$cached" "$([ ${#no_cache[@]} -gt 0 ] && echo true || echo false)" \
      >>"$IMAGES_SUMMARY_JSON"
  fi
done

printf '\n%-44s %9s %7s  %-5s  %s\n' image size build cache base
printf '%s\n' "${summary[@]}"
say "done"
