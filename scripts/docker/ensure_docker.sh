#!/usr/bin/env bash
# Make `docker` and a compose command usable: install Debian's docker.io and docker-compose when
# missing (as root), and start dockerd when no daemon answers. Prints the compose command to use.
# When it started dockerd, it writes the daemon's PID to $PAGEDSERVE_DOCKERD_PIDFILE (if set), so
# the caller can stop it again.
set -euo pipefail

log() { echo "ensure_docker: $*" >&2; }

if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null \
        || { ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; }; then
    [ "$(id -u)" = 0 ] || { log "docker is missing and only root can install it (apt-get install docker.io docker-compose)"; exit 1; }
    log "installing docker.io and docker-compose with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q docker.io docker-compose debootstrap >&2
fi

if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { log "no docker daemon answers, and only root can start one"; exit 1; }
    log "starting dockerd (log: /tmp/pagedserve-dockerd.log)"
    nohup dockerd >/tmp/pagedserve-dockerd.log 2>&1 &
    pid=$!
    [ -n "${PAGEDSERVE_DOCKERD_PIDFILE:-}" ] && echo "$pid" > "$PAGEDSERVE_DOCKERD_PIDFILE"
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || { log "dockerd exited:"; tail -20 /tmp/pagedserve-dockerd.log >&2; exit 1; }
        sleep 1
    done
    docker info >/dev/null 2>&1 || { log "dockerd did not answer within 60 s"; exit 1; }
fi

# Compose v2 (`docker compose`) where the plugin exists, else Debian's docker-compose 1.29:
# both read compose.yaml.
if docker compose version >/dev/null 2>&1; then echo "docker compose"; else echo "docker-compose"; fi
