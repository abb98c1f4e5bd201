#!/usr/bin/env bash
# Build Prometheus (the server: PromQL engine, TSDB, scraper, HTTP API) from the Go module proxy, like
# hack/build-control-plane.sh, cached by version under $KASCADE_CACHE/bin/prometheus-<version>/ and
# linked as $KASCADE_CACHE/bin/prometheus-current. Prints the bin directory on success.
#
# Prometheus 3.x is published as Go module versions v0.3MM.P (v0.316.0 = Prometheus 3.16.0); its go.mod
# has no replace directives, so `go build` of the main package works directly. `remove_all_sd` drops
# every cloud service discovery (AWS, Azure, GCE, ...) but `enable_kubernetes_sd` keeps Kubernetes': the
# e2e discovers engine pods from the real API server with the chart's PodMonitor turned into a scrape
# config (kascade_devcluster/podmonitor.py); client-go is mostly in the Go cache already from the
# control-plane build (17 CPU-s more here). Without the `builtinassets` tag the web UI is not
# embedded; the HTTP API (/api/v1/*) the operator and the tests use is complete. promtool (rule checks
# and alert unit tests) comes from the same module in the same `go build`: it shares most packages, so it
# adds ~100 CPU-s to a cold build (measured with a warm cache for prometheus: 108 CPU-s).
set -euo pipefail

PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-v0.316.0}
CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}
TAGS=remove_all_sd,enable_kubernetes_sd
BIN=$CACHE/bin/prometheus-$PROMETHEUS_VERSION-k8s-sd   # the flavour is in the name: a cache without k8s SD rebuilds
WORK=$CACHE/build/prometheus-$PROMETHEUS_VERSION
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=${GOFLAGS:--mod=mod}
export CGO_ENABLED=0

log() { echo "[build-prometheus] $(date +%H:%M:%S) $*" >&2; }

if [ ! -x "$BIN/prometheus" ] || [ ! -x "$BIN/promtool" ]; then
  mkdir -p "$BIN" "$WORK"
  start=$(date +%s)
  log "building prometheus + promtool $PROMETHEUS_VERSION (module proxy; cold build a few minutes on 2 cores)"
  cd "$WORK"
  [ -f go.mod ] || go mod init local/kascade-prometheus-builder >/dev/null 2>&1
  go get -tags "$TAGS" "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  V=github.com/prometheus/common/version
  # v0.316.0 -> 3.16.0 (what `prometheus --version` prints)
  minor=$(echo "$PROMETHEUS_VERSION" | sed -E 's/^v0\.3([0-9]+)\.([0-9]+).*/\1/' | sed 's/^0*//')
  patch=$(echo "$PROMETHEUS_VERSION" | sed -E 's/^v0\.3[0-9]+\.([0-9]+).*/\1/')
  rm -rf "$WORK/out" && mkdir -p "$WORK/out"
  go build -trimpath -tags "$TAGS" -ldflags "-s -w -X $V.Version=3.${minor:-0}.$patch -X $V.Branch=module" \
    -o "$WORK/out/" github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
  mv "$WORK/out/promtool" "$BIN/promtool"
  mv "$WORK/out/prometheus" "$BIN/prometheus"   # last: its presence with promtool's means a complete build
  log "built in $(( $(date +%s) - start )) s"
fi

ln -sfn "$BIN" "$CACHE/bin/prometheus-current"   # what the test fixtures use
log "ready in $BIN (linked as $CACHE/bin/prometheus-current)"
echo "$BIN"
