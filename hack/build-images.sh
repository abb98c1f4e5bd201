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
# The dependency layer (each Dockerfile's `deps` stage: the base, the user, the locked venv) is built once per
# key (a hash of the Dockerfile's stages up to `project`, requirements/ and the base image's ID), tagged kascade-cache/<image>-deps:<key>
# and kept as a `docker save` tarball in $KASCADE_CACHE/images/deps: on a machine whose Docker store is gone
# but whose ~/.cache is kept (CI), `docker load` brings it back and only the project layer is built.
#   KASCADE_DEPS_CACHE=0            build every stage from the Dockerfile (no kept dependency layer)
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

# BuildKit (it skips the stages a build does not need, so a build from a kept dependency image never
# touches the multi-GB `build` stage): through buildx when the CLI has it; else through a CLI that still
# speaks BuildKit itself (Debian's docker.io 20.10, /usr/bin/docker, beside a newer static CLI without buildx);
# else the legacy builder (every stage, cached by the daemon's layer cache only)
DOCKER=docker
if docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=1
elif [ -x /usr/bin/docker ] && [ "$(/usr/bin/docker version -f '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)" -lt 23 ] 2>/dev/null; then
  DOCKER=/usr/bin/docker; export DOCKER_BUILDKIT=1
else
  export DOCKER_BUILDKIT=0
fi
DEPS_CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}/images/deps
mkdir -p "$DEPS_CACHE"

# the image the final stage starts from (DEPS): kept, loaded, or built here and kept
deps_image() {  # image, base, build args...
  local image=$1 base=$2 key tag tar t0; shift 2
  # the Dockerfile up to the project stage (pybase, build, deps): a change below it keeps the layer
  key=$({ sed '/^FROM .* AS project$/q' "${dockerfile[$image]}"; find requirements -type f | LC_ALL=C sort | xargs cat
          cat hack/torch-cuda-stub.py
          docker image inspect -f '{{.Id}}' "$base"; echo "${variant[$image]}"; } | sha256sum | cut -c1-16)
  tag=kascade-cache/$image-deps:$key
  tar=$DEPS_CACHE/$image-$key.tar
  if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag"; return; fi
  t0=$(date +%s)
  if [ -s "$tar" ]; then
    docker load -q -i "$tar" >/dev/null
    log "$tag loaded from $tar in $(( $(date +%s) - t0 )) s"
  else
    log "building the dependency layer $tag (minutes: every locked wheel)"
    $DOCKER build -f "${dockerfile[$image]}" --target deps -t "$tag" "$@" . >"$LOGS/$image-deps.log" 2>&1 || {
      tail -n 40 "$LOGS/$image-deps.log" >&2; log "$tag failed (full log: $LOGS/$image-deps.log)"; exit 1; }
    log "$tag built in $(( $(date +%s) - t0 )) s; saving it to $tar"
    rm -f "$DEPS_CACHE/$image"-*.tar  # other keys
    # and their images, and BuildKit's cache of the build stage (the whole CUDA venv: GBs that CI's disk
    # kept for nothing, since the dependency layer is kept as an image and a tarball)
    docker image ls --format '{{.Repository}}:{{.Tag}}' "kascade-cache/$image-deps" | grep -vx "$tag" \
      | xargs -r docker image rm >/dev/null 2>&1 || true
    $DOCKER builder prune -f >/dev/null 2>&1 || true
    docker save "$tag" -o "$tar.tmp" && mv "$tar.tmp" "$tar"
    log "$tar: $(du -h "$tar" | cut -f1) in $(( $(date +%s) - t0 )) s in all"
  fi
  echo "$tag"
}

for image in $IMAGES; do
  [ -n "${dockerfile[$image]:-}" ] || { log "unknown image $image (operator, engine, engine-cpu)"; exit 2; }
  base=$(pick_base "${registry_base[$image]}")
  args=(--build-arg "BASE=$base" --build-arg "VERSION=$TAG")
  [ -n "${variant[$image]}" ] && args+=(--build-arg "VARIANT=${variant[$image]}")
  t0=$(date +%s)
  if [ "${KASCADE_DEPS_CACHE:-1}" != 0 ]; then
    args+=(--build-arg "DEPS=$(deps_image "$image" "$base" "${args[@]}" "${ca_args[@]}")")
  fi
  log "building ${name[$image]} from ${dockerfile[$image]} on $base"
  blog=$LOGS/$image.log
  old_id=$(docker image inspect -f '{{.Id}}' "${name[$image]}" 2>/dev/null || true)
  $DOCKER build -f "${dockerfile[$image]}" -t "${name[$image]}" "${args[@]}" "${ca_args[@]}" . >"$blog" 2>&1 || {
    tail -n 40 "$blog" >&2; log "${name[$image]} failed (full log: $blog)"; exit 1; }
  # the image this tag named before, untagged now (only if nothing else uses it)
  [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "${name[$image]}")" ] \
    && docker image rm "$old_id" >/dev/null 2>&1 || true
  log "${name[$image]}: $(docker image inspect -f '{{.Size}}' "${name[$image]}" | awk '{printf "%.2f GB", $1/1e9}') in $(( $(date +%s) - t0 )) s"
done
