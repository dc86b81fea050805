#!/usr/bin/env bash
# `make compose-test`: build the image and run tests/compose against the real stack
# (`docker compose up`, scaling, restarts, API key, `down -v`). Installs docker and starts dockerd
# when missing (root); where no registry is reachable, builds the base image with debootstrap;
# passes this machine's pip CA bundle and local torch wheel into the build without keeping them.
# Stops a dockerd it started itself, so it leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
EXTRAS=docker/build-extras

dockerd_pidfile=$(mktemp)
staged=()
cleanup() {
    for f in "${staged[@]}"; do rm -f "$f"; done
    if [ -s "$dockerd_pidfile" ]; then
        pid=$(cat "$dockerd_pidfile")
        echo "compose-test: stopping the dockerd it started (pid $pid)"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    fi
    rm -f "$dockerd_pidfile"
}
trap cleanup EXIT

export PAGEDSERVE_DOCKERD_PIDFILE=$dockerd_pidfile
COMPOSE=$(scripts/docker/ensure_docker.sh)
BASE=$(scripts/docker/base_image.sh)

# pip's settings here (pip config list: cert=..., find-links=...) name the CA bundle and the
# directory holding the CPU torch wheel; hand both to the build through docker/build-extras/.
pip_setting() { "$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*$1='\(.*\)'$/\1/p" | head -1; }
cert=${PIP_CERT:-$(pip_setting cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" "$EXTRAS/ca.crt"; staged+=("$EXTRAS/ca.crt")
fi
torch_index=https://download.pytorch.org/whl/cpu
for dir in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do
    for wheel in "$dir"/torch-2.13.*+cpu-cp311-*.whl; do
        [ -f "$wheel" ] || continue
        ln -f "$wheel" "$EXTRAS/" 2>/dev/null || cp "$wheel" "$EXTRAS/"
        staged+=("$EXTRAS/$(basename "$wheel")")
        torch_index=""  # the local CPU wheel stands in for PyTorch's index
        break 2
    done
done

export PAGEDSERVE_BASE_IMAGE=$BASE PAGEDSERVE_TORCH_INDEX_URL=$torch_index
echo "compose-test: building pagedserve:latest on $BASE with $COMPOSE"
start=$(date +%s)
$COMPOSE -p pagedserve-compose-test build scheduler
echo "compose-test: image built in $(( $(date +%s) - start )) s;" \
     "size $(docker image inspect -f '{{.Size}}' pagedserve:latest | awk '{printf "%.0f MB", $1/1e6}')"
for f in "${staged[@]}"; do rm -f "$f"; done; staged=()
docker image prune -f >/dev/null  # the images earlier builds left untagged (the build cache stays)

PAGEDSERVE_COMPOSE="$COMPOSE" "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m compose tests/compose "$@"
