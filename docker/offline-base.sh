#!/usr/bin/env bash
# An offline stand-in for python:3.11-slim-bookworm, for machines that reach Debian's mirror and PyPI
# but no container registry. Prints the image's tag on stdout (progress on stderr).
#
# Debian bookworm (minbase) with python3 (3.11), python3-venv and ca-certificates, made by debootstrap
# from the mirror in this machine's apt sources and imported with `docker import`. It behaves like
# python:slim where the Dockerfiles care: a venv (/opt/venv) first on PATH, so `python` and `pip
# install` work as root without PEP 668 complaints; Debian's apt sources (bookworm, -updates,
# -security) so `apt-get install` works; this machine's CA bundle, named by PIP_CERT,
# REQUESTS_CA_BUNDLE and SSL_CERT_FILE, so pip trusts what the host trusts.
#
# Tagged tilert-pd/debian-python:bookworm-<hash of its inputs> (this file, the mirror, the CA bundle)
# and made only when that tag is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

ca=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  # The first URIs/deb line of the machine's apt sources that is not the security archive.
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | sed -n -e 's/^URIs:[[:space:]]*//p' -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p' \
    | awk '{print $1}' | grep -v -- '-security' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
security=${DEBIAN_SECURITY_MIRROR:-${mirror%/debian}/debian-security}
[ -r "$ca" ] || { echo "offline-base: no CA bundle at $ca" >&2; exit 1; }

hash=$( { cat "$0"; echo "$mirror $security"; cat "$ca"; } | sha256sum | cut -c1-12)
tag=tilert-pd/debian-python:bookworm-$hash
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "==> offline base $tag is up to date" >&2
  echo "$tag"; exit 0
fi

[ "$(id -u)" -eq 0 ] || { echo "offline-base: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null 2>&1 || {
  echo "==> installing debootstrap (apt)" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
}

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/tilert-pd-rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
start=$SECONDS
echo "==> offline base: debootstrap bookworm from $mirror (a few minutes)" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
  >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"

# Apt sources as in Debian's own images (deb822), from this machine's mirror.
rm -f "$rootfs/etc/apt/sources.list"
cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# Docker's Debian images keep no apt caches and install no recommends; the same here.
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT
echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/no-recommends"

# The host's CA bundle under a name of its own: update-ca-certificates (run when a package installs
# certificates) rewrites ca-certificates.crt, never this file.
install -m 0644 "$ca" "$rootfs/etc/ssl/certs/host-ca-bundle.crt"
chroot "$rootfs" /usr/bin/python3 -m venv /opt/venv
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
       "$rootfs"/var/log/*.log "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*

echo "==> offline base: importing as $tag" >&2
cab=/etc/ssl/certs/host-ca-bundle.crt
tar -C "$rootfs" -c . | docker import \
  --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV VIRTUAL_ENV=/opt/venv" \
  --change "ENV LANG=C.UTF-8" \
  --change "ENV PIP_CERT=$cab" \
  --change "ENV REQUESTS_CA_BUNDLE=$cab" \
  --change "ENV SSL_CERT_FILE=$cab" \
  --change 'CMD ["python3"]' \
  --message "tilert-pd offline base: debootstrap bookworm minbase + python3 + venv ($mirror)" \
  - "$tag" >/dev/null
echo "==> offline base $tag made in $((SECONDS - start))s" >&2
echo "$tag"
