#!/usr/bin/env bash
# Kascade on kind, for Docker users (the dev machines have no Docker, so this is not run there; the
# chart values and the ModelService it uses are checked by tests/chart and tests/api).
# Builds the image, creates a 2-worker cluster whose nodes advertise fake GPUs (an extended resource
# patched into node status) and leaf labels, installs the chart, applies a ModelService for a tiny
# random Llama generated here, and checks: the first copy loads from disk; raising min to 2 makes a
# chain ScalePlan succeed. KEEP=1 leaves the cluster running.
set -euo pipefail
need() { command -v "$1" >/dev/null || { echo "e2e-kind: '$1' is required" >&2; exit 2; }; }
need docker; need kind; need kubectl; need helm
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CLUSTER=${KASCADE_KIND_CLUSTER:-kascade-e2e}
MODELS=/tmp/kascade-kind-models
PY=${PY:-$REPO/.venv/bin/python}
NS=kascade
cleanup() { [ "${KEEP:-}" = 1 ] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== model: tiny random Llama in $MODELS/tiny-kind"
mkdir -p "$MODELS"
"$PY" -c "from pathlib import Path; from kascade_engine.weights.checkpoint import tiny_llama; \
tiny_llama(Path('$MODELS/tiny-kind'), layers=8, hidden=256, vocab=2048)"
echo "== image kascade:e2e"
# the engine image (it carries the operator too), CPU variant: kind nodes have no GPUs
docker build -t kascade:e2e --build-arg BASE=ubuntu:24.04 "$REPO"
echo "== cluster $CLUSTER"
kind create cluster --name "$CLUSTER" --config "$REPO/e2e/kind/kind-config.yaml" --wait 120s
kind load docker-image kascade:e2e --name "$CLUSTER"
i=0
for node in $(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
  kubectl label "$node" kascade.io/leaf="leaf-$((i % 2))" kascade.io/scaleup-domain="${node#node/}" \
    kascade.io/nic-gbps=100 --overwrite
  kubectl patch "$node" --subresource=status --type=json \
    -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"4"}]'
  i=$((i + 1))
done
echo "== helm install"
helm install kascade "$REPO/charts/kascade" -n "$NS" --create-namespace -f "$REPO/e2e/kind/values.yaml" \
  --wait --timeout 5m
kubectl -n "$NS" apply -f "$REPO/e2e/kind/modelservice.yaml"

wait_for() {  # what, command...
  local what=$1; shift
  for _ in $(seq 1 180); do
    if "$@" >/dev/null 2>&1; then echo "ok: $what"; return 0; fi
    sleep 1
  done
  echo "e2e-kind: timed out waiting for $what" >&2
  kubectl -n "$NS" get msvc,splan,pods -o wide >&2 || true
  kubectl -n "$NS" logs deploy/kascade-operator --tail=100 >&2 || true
  return 1
}
ready() { kubectl -n "$NS" get msvc tiny -o jsonpath='{.status.readyReplicas}' | grep -qx "$1"; }
wait_for "first copy loaded" ready 1
kubectl -n "$NS" patch msvc tiny --type=merge -p '{"spec":{"replicas":{"colocated":{"min":2}}}}'
chain_done() {
  kubectl -n "$NS" get splan -o jsonpath='{range .items[*]}{.spec.algorithm}={.status.phase}{"\n"}{end}' \
    | grep -qx chain=Succeeded
}
wait_for "chain ScalePlan succeeded" chain_done
wait_for "2 ready replicas" ready 2
kubectl -n "$NS" get msvc,splan
echo "e2e-kind: passed"
