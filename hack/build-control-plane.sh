#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# etcd, KWOK, Helm) from the Go module proxy, cached by version under $KASCADE_CACHE so that only
# the first build is slow. Prints the bin directory on success.
#
# Why Go modules: no Docker here, and the distro packages are too old (etcd 3.4 lacks /readyz and
# RequestWatchProgress). Go 1.27 breaks kube-openapi, so this refuses anything but Go 1.26.x.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_VERSION=${HELM_VERSION:-v3.21.4}
CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}
BIN=$CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION
WORK=$CACHE/build
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=${GOFLAGS:--mod=mod}
export CGO_ENABLED=0

log() { echo "[build-control-plane] $(date +%H:%M:%S) $*" >&2; }

gov=$(go env GOVERSION)
case "$gov" in
  go1.26*) ;;
  *) log "need Go 1.26.x (Go 1.27 serves a broken OpenAPI), found $gov"; exit 2 ;;
esac

mkdir -p "$BIN" "$WORK"
have() { [ -x "$BIN/$1" ]; }

# A builder module that depends on k8s.io/kubernetes. Its published go.mod requires the staging modules
# at v0.0.0 and replaces them locally; replaces in a dependency are ignored, so pin every staging
# module to the matching v0.Y.Z ourselves. Idempotent: kubectl reuses it after a partial cache.
minor=$(echo "$K8S_VERSION" | cut -d. -f2)
V=k8s.io/component-base/version
k8s_ldflags="-s -w -X $V.gitVersion=$K8S_VERSION -X $V.gitMajor=1 -X $V.gitMinor=$minor -X $V.gitTreeState=clean"
K8S_BUILDER=$WORK/k8s-$K8S_VERSION
k8s_builder() {  # not via $(...): errexit does not reach into command substitutions
  local d=$K8S_BUILDER
  if [ ! -f "$d/.ready" ]; then
    rm -rf "$d"; mkdir -p "$d"
    (cd "$d"
     printf 'module local/kascade-k8s-builder\n\ngo 1.%d.0\ngodebug default=go1.%d\n' $((minor - 10)) $((minor - 10)) > go.mod
     gomodfile=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
     for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomodfile"); do
       go mod edit -replace="$m=$m@v0.${K8S_VERSION#v1.}"
     done
     go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
     go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
                  "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
                  "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION" \
                  "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION"
     touch .ready)
  fi
}

for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  have $c && continue
  k8s_builder
  log "go build $c $K8S_VERSION (cold kube-apiserver: ~8 min on 2 cores)"
  (cd "$K8S_BUILDER" && go build -trimpath -ldflags "$k8s_ldflags" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c")
  mv "$BIN/$c.tmp" "$BIN/$c"
done

if ! have etcd; then
  log "building etcd $ETCD_VERSION"
  d=$WORK/etcd-$ETCD_VERSION; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init local/kascade-etcd-builder >/dev/null 2>&1
  go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$BIN/etcd.tmp" "$BIN/etcd"
fi

if ! have kwok; then
  log "building kwok $KWOK_VERSION"
  GOBIN=$BIN go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
fi
# kwok's stage definitions ship in its module zip; standalone kwok needs them via --config.
if [ ! -f "$BIN/kwok-stages.yaml" ]; then
  moddir=$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  : > "$BIN/kwok-stages.yaml.tmp"
  # The "fast" stages: nodes Ready and pods Running without artificial delays.
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    p=$moddir/kustomize/stage/$f
    [ -f "$p" ] || { log "kwok stage $f not found in $moddir"; exit 3; }
    { echo "---"; cat "$p"; echo; } >> "$BIN/kwok-stages.yaml.tmp"
  done
  mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
fi

# Helm's own release ldflags: its version, and the Kubernetes version `helm template` / `helm lint`
# assume without a cluster (else v1.20, and a chart's kubeVersion >=1.29 refuses to render). A helm
# cached without them is rebuilt (the Go build cache makes that a link step).
helm_ok() { have helm && [ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; }
if ! helm_ok; then
  log "building helm $HELM_VERSION"
  H=helm.sh/helm/v3
  helm_k8s_minor=$(GOFLAGS= go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])' \
    | xargs sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p')
  GOBIN=$BIN go install -ldflags "-s -w -X $H/internal/version.version=$HELM_VERSION -X $H/internal/version.gitTreeState=clean \
    -X $H/pkg/chartutil.k8sVersionMajor=1 -X $H/pkg/chartutil.k8sVersionMinor=$helm_k8s_minor \
    -X $H/pkg/lint/rules.k8sVersionMajor=1 -X $H/pkg/lint/rules.k8sVersionMinor=$helm_k8s_minor" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi

ln -sfn "$BIN" "$CACHE/bin/current"   # what the test fixtures and `kascade cluster` use
log "ready in $BIN (linked as $CACHE/bin/current)"
echo "$BIN"
