#!/usr/bin/env bash
# Print a base image for the Dockerfile (BASE_IMAGE): python:3.11-slim when a registry can give it,
# else a Debian 12 image made here with debootstrap from the apt mirror this machine already uses
# (tagged pagedserve-base:bookworm, reused once made). The made image also carries g++ and Python's
# headers, which the worker needs to build its kernels.
set -euo pipefail

log() { echo "base_image: $*" >&2; }
WANTED=${PAGEDSERVE_BASE_IMAGE:-python:3.11-slim}
LOCAL=pagedserve-base:bookworm

if docker image inspect "$WANTED" >/dev/null 2>&1 || timeout 60 docker pull -q "$WANTED" >/dev/null 2>&1; then
    echo "$WANTED"; exit 0
fi
if docker image inspect "$LOCAL" >/dev/null 2>&1; then
    echo "$LOCAL"; exit 0
fi
log "cannot pull $WANTED: making $LOCAL with debootstrap"
command -v debootstrap >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; }

# The mirror apt uses here: deb822 sources (URIs:) or a classic sources.list line.
mirror=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1 | awk '{print $2}')
[ -n "$mirror" ] || mirror=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                            | grep -v security | head -1 | awk '{print $2}')
[ -n "$mirror" ] || { log "no apt mirror found in /etc/apt/sources.list*"; exit 1; }

root=$(mktemp -d /tmp/pagedserve-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python3-dev,g++,ca-certificates \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
tar -C "$root" --exclude=./var/cache/apt/archives --exclude=./var/lib/apt/lists -c . \
    | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$LOCAL" >/dev/null
log "made $LOCAL from $mirror"
echo "$LOCAL"
