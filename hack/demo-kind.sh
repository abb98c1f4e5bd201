#!/usr/bin/env bash
# `make demo-kind`: the Kascade demo in pods on a kind cluster, everything built on this machine.
#
# Builds what is missing (each cached under ~/.cache/kascade: a warm run skips them in seconds), then runs
# `kascade demo-kind`: the cluster (kept afterwards), our images in its nodes, the chart with its own
# operator, router and pool Deployments, a ModelService, a burst through the router's Service, and the
# scale-up and scale-down as they happen. Cold (nothing cached) the builds take 40-60 minutes on 2 cores;
# every stage prints its time. docs/kind.md.
set -euo pipefail
cd "$(dirname "$0")/.."
t_all=$SECONDS
step() { printf '\n\033[1m[demo-kind] %s\033[0m\n' "$*" >&2; }
timed() {  # label, command...: runs it showing its progress lines, prints its time; full log in $LOGS/<label>.log
  local label=$1 t0=$SECONDS rc; shift
  step "$label ..."
  set +e
  "$@" 2>&1 | tee "$LOGS/$label.log" | { grep --line-buffered -E '^\[(build-|docker-up)' >&2 || true; }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then
    echo "[demo-kind] $label failed (exit $rc); the end of its log ($LOGS/$label.log):" >&2
    tail -20 "$LOGS/$label.log" >&2
    exit "$rc"
  fi
  step "$label done in $((SECONDS - t0)) s"
}
LOGS=${KASCADE_DEMO_KIND_LOGS:-kascade-demo-kind/logs}
mkdir -p "$LOGS"
[ -x .venv/bin/kascade ] || { echo "no .venv/bin/kascade: run \`make install\` first" >&2; exit 1; }

timed docker bash hack/docker-up.sh
timed control-plane bash hack/build-control-plane.sh   # kubectl and helm (make install built them)
timed kind bash hack/build-kind.sh                     # kind, the node image and the cluster's images
timed images env TAG="$(bash hack/image-tag.sh)" IMAGES="operator engine-cpu" bash hack/build-images.sh
step "builds ready in $((SECONDS - t_all)) s; the demo:"
exec .venv/bin/kascade demo-kind "$@"
