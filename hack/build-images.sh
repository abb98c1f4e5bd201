#!/usr/bin/env bash
# `make images`: build the operator image and the engine image(s) from the repo's Dockerfiles, tagged
# with what the chart pulls by default (repository from charts/kascade/values.yaml, tag = the chart's
# appVersion), so `helm install` and `kind load docker-image` need no --set.
#   operator    ghcr.io/kascade/kascade-operator:<appVersion>      Dockerfile.operator
#   engine      ghcr.io/kascade/kascade-engine:<appVersion>        Dockerfile (CUDA 12 wheels)
#   engine-cpu  ghcr.io/kascade/kascade-engine:<appVersion>-cpu    Dockerfile VARIANT=cpu (kind, CPU nodes)
# Bases: the Dockerfiles' registry defaults when they are present locally or can be pulled; otherwise (no
# registry reachable, or KASCADE_LOCAL_BASE=1) kascade/base:bookworm from hack/build-base-image.sh.
#   IMAGES="operator engine-cpu"   what to build (default: operator engine-cpu engine)
#   TAG=...  REGISTRY=...           override the tag / the registry prefix (default ghcr.io/kascade)
#   --list                          print "<image> <name>" for each of IMAGES and build nothing
#   KASCADE_BUILD_CA_FILE=FILE      PEM certificates pip must trust in the build (default: the host's
#                                   locally added CAs, /usr/local/share/ca-certificates/*.crt)
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[build-images] $(date +%H:%M:%S) $*" >&2; }

TAG=${TAG:-$(bash hack/image-tag.sh)}
REGISTRY=${REGISTRY:-ghcr.io/kascade}
IMAGES=${IMAGES:-operator engine-cpu engine}
LOGS=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}/images/logs
mkdir -p "$LOGS"

declare -A dockerfile=([operator]=Dockerfile.operator [engine]=Dockerfile [engine-cpu]=Dockerfile)
declare -A name=([operator]=$REGISTRY/kascade-operator:$TAG [engine]=$REGISTRY/kascade-engine:$TAG
                 [engine-cpu]=$REGISTRY/kascade-engine:$TAG-cpu)
declare -A registry_base=([operator]=python:3.12-slim-bookworm [engine]=nvidia/cuda:12.8.1-base-ubuntu24.04
                          [engine-cpu]=ubuntu:24.04)
declare -A variant=([operator]="" [engine]=cuda [engine-cpu]=cpu)

if [ "${1:-}" = --list ]; then
  for image in $IMAGES; do echo "$image ${name[$image]:?unknown image $image}"; done
  exit 0
fi
bash hack/docker-up.sh

local_base=""
pick_base() {  # the registry base if it is here or pullable, else the local Debian base
  local want=$1
  if [ "${KASCADE_LOCAL_BASE:-0}" != 1 ]; then
    if docker image inspect "$want" >/dev/null 2>&1 || timeout 60 docker pull -q "$want" >/dev/null 2>&1; then
      echo "$want"; return
    fi
    log "cannot pull $want (no registry reachable?): using the local Debian base"
  fi
  [ -n "$local_base" ] || local_base=$(bash hack/build-base-image.sh)
  echo "$local_base"
}

ca_args=()
ca_file=${KASCADE_BUILD_CA_FILE:-}
if [ -z "$ca_file" ] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  ca_file=$(mktemp); trap 'rm -f "$ca_file"' EXIT
  cat /usr/local/share/ca-certificates/*.crt >"$ca_file"
fi
[ -n "$ca_file" ] && ca_args=(--build-arg "EXTRA_CA_CERTS=$(cat "$ca_file")")

# the legacy builder when buildx is absent (a 23+ CLI refuses BuildKit without it; the 20.10 daemon's
# BuildKit would also try to pull a frontend image)
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

for image in $IMAGES; do
  [ -n "${dockerfile[$image]:-}" ] || { log "unknown image $image (operator, engine, engine-cpu)"; exit 2; }
  base=$(pick_base "${registry_base[$image]}")
  args=(--build-arg "BASE=$base" --build-arg "VERSION=$TAG")
  [ -n "${variant[$image]}" ] && args+=(--build-arg "VARIANT=${variant[$image]}")
  t0=$(date +%s)
  log "building ${name[$image]} from ${dockerfile[$image]} on $base"
  blog=$LOGS/$image.log
  docker build -f "${dockerfile[$image]}" -t "${name[$image]}" "${args[@]}" "${ca_args[@]}" . >"$blog" 2>&1 || {
    tail -n 40 "$blog" >&2; log "${name[$image]} failed (full log: $blog)"; exit 1; }
  log "${name[$image]}: $(docker image inspect -f '{{.Size}}' "${name[$image]}" | awk '{printf "%.2f GB", $1/1e9}') in $(( $(date +%s) - t0 )) s"
done
