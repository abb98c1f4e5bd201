#!/usr/bin/env bash
# Make sure a Docker daemon answers: install Debian's docker.io and debootstrap when missing (root + apt
# only), and start dockerd by hand when nothing listens on its socket (these machines have no systemd).
# Idempotent: with a daemon up it only checks. Used by `make images` (hack/build-images.sh), the kind e2e
# and hack/install.sh (KASCADE_CONTAINERS=1 or CI=true).
#   KASCADE_DOCKER_LOG  dockerd's log when started here (default ~/.cache/kascade/dockerd.log)
set -euo pipefail
CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}
LOG=${KASCADE_DOCKER_LOG:-$CACHE/dockerd.log}
log() { echo "[docker-up] $(date +%H:%M:%S) $*" >&2; }

need_apt=()
command -v docker >/dev/null || need_apt+=(docker.io)
command -v dockerd >/dev/null || need_apt+=(docker.io)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      $(printf '%s\n' "${need_apt[@]}" | sort -u) >/dev/null
  else
    log "missing ${need_apt[*]}: install Docker (and debootstrap for a local base image) with your package manager"
    exit 1
  fi
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  log "no Docker daemon answers and this is not root: start Docker (or add yourself to the docker group)"
  exit 1
fi
if [ -S /var/run/docker.sock ] && pgrep -x dockerd >/dev/null; then
  log "dockerd runs but does not answer yet; waiting"
else
  mkdir -p "$(dirname "$LOG")"
  log "starting dockerd (log: $LOG)"
  # setsid: the daemon outlives this script and the make that ran it
  setsid dockerd >"$LOG" 2>&1 </dev/null &
fi
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    log "dockerd up: $(docker info --format '{{.ServerVersion}} {{.Driver}} cgroup {{.CgroupVersion}}' 2>/dev/null)"
    exit 0
  fi
  sleep 1
done
log "dockerd did not answer within 60 s; last lines of $LOG:"
tail -n 20 "$LOG" >&2 || true
exit 1
