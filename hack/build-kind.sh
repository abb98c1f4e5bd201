#!/usr/bin/env bash
# Build everything a kind cluster needs on a machine that cannot reach any image registry, cached under
# $KASCADE_CACHE/kind so only the first run is slow. Prints the node image name on success.
#
# Stages (each prints its time):
#   kind        sigs.k8s.io/kind built with Go
#   node-tools  containerd, runc, crictl, CNI plugins built with Go (runc needs libseccomp-dev)
#   kube-node   kubelet, kubeadm, kube-proxy from the same builder module as hack/build-control-plane.sh
#   rootfs      a Debian rootfs from debootstrap with systemd and what kindest/base installs
#   base        the kind base image: that rootfs + kind's own files (entrypoint, systemd units,
#               containerd config, from the kind module source) + the node tools
#   images      the cluster's images built here: kube-apiserver/-controller-manager/-scheduler/-proxy,
#               etcd, pause, CoreDNS and the pod network DaemonSet's image (kindnet is not on the proxy)
#   node        the node image, assembled as `kind build node-image` does (binaries into /usr/bin, images
#               imported into containerd's store, `docker commit`). kind's own builder cannot be used: it
#               `ctr content fetch`es every image not among the tarball's four from the registry.
#   cache       the node image is also kept as a `docker save` tarball ($KASCADE_CACHE/kind/images), keyed by
#               a hash of these two scripts and the versions: with /var/lib/docker gone (a fresh CI machine
#               that keeps ~/.cache) `docker load` brings it back in ~30 s and every other stage is skipped.
# FORCE=1 rebuilds the images (not the Go binaries, which the Go build cache makes cheap anyway).
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
KIND_VERSION=${KIND_VERSION:-v0.33.0}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
RUNC_VERSION=${RUNC_VERSION:-v1.5.3}
CRICTL_VERSION=${CRICTL_VERSION:-v1.37.0}
CNI_VERSION=${CNI_VERSION:-v1.10.0}
COREDNS_VERSION=${COREDNS_VERSION:-v1.14.7}  # kubeadm asks for v1.14.2, which the proxy does not serve: tagged as that
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KASCADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kascade}
KC=$CACHE/kind
BIN=$KC/bin
WORK=$KC/work
NODE_TOOLS=$KC/node-tools-containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION-crictl-$CRICTL_VERSION-cni-$CNI_VERSION
KUBE_BIN=$KC/kube-$K8S_VERSION
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=${GOFLAGS:--mod=mod}
PREFIX=kascade-kind
BASE_IMAGE=$PREFIX/base:containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION-$DEBIAN_SUITE  # + a hash of build_base below
NODE_IMAGE=${KASCADE_KIND_NODE_IMAGE:-$PREFIX/node:$K8S_VERSION}
NICE="nice -n 10"

log() { echo "[build-kind] $(date +%H:%M:%S) $*" >&2; }
stage() {  # name, function: runs it and prints its wall time (ONLY="a b": just those stages)
  local t0=$SECONDS
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return 0; fi
  log "stage $1 ..."
  "$2"
  log "stage $1 done in $((SECONDS - t0)) s"
}
image_exists() { [ "${FORCE:-}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }
mkdir -p "$BIN" "$WORK" "$NODE_TOOLS" "$KUBE_BIN"
moddir() { GOFLAGS= go mod download -json "$1" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])'; }

# Capabilities the host's bounding set lacks (measured on the dev machines: CAP_SYS_RESOURCE). Docker
# 20.10's --privileged asks for every capability, so `docker run/exec --privileged` fails there with
# "unable to apply caps: operation not permitted", and kind runs its nodes that way.
missing_caps() {
  python3 - "$(cat /proc/sys/kernel/cap_last_cap)" "$(awk '/^CapBnd/ {print $2}' /proc/"$(pgrep -xo dockerd || echo self)"/status)" <<'PY'
import sys
names = ("CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
         "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
         "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
         "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
         "PERFMON BPF CHECKPOINT_RESTORE").split()
last, bnd = int(sys.argv[1]), int(sys.argv[2], 16)
print(" ".join(names[i] for i in range(min(last + 1, len(names))) if not bnd >> i & 1))
PY
}

# kind itself. Where --privileged cannot work, kind is built from its module source with the node
# containers' --privileged replaced by what it grants that kind needs: every capability the host has,
# no seccomp/AppArmor/masked paths, every device allowed (the node image's entrypoint-unprivileged makes
# /sys and the cgroup mounts writable, as --privileged would); `docker exec` inherits the node's caps.
build_kind() {
  local drop want have="" src
  drop=$(missing_caps)
  want="$KIND_VERSION${drop:+ without --privileged (host lacks: $drop)}"
  [ -f "$BIN/kind.build" ] && have=$(cat "$BIN/kind.build")
  [ -x "$BIN/kind" ] && [ "$have" = "$want" ] && return 0
  if [ -z "$drop" ]; then
    GOBIN=$BIN CGO_ENABLED=0 $NICE go install "sigs.k8s.io/kind@$KIND_VERSION"
  else
    log "this host cannot run privileged containers (no $drop in its capability bounding set): patching kind"
    src=$WORK/kind-src; rm -rf "$src"; cp -r "$(moddir "sigs.k8s.io/kind@$KIND_VERSION")" "$src"; chmod -R u+w "$src"
    local args='"--cap-add=ALL",' c d=$src/pkg/cluster/internal/providers/docker
    for c in $drop; do args="$args \"--cap-drop=$c\","; done
    args="$args \"--security-opt\", \"systempaths=unconfined\", \"--device-cgroup-rule=a *:* rwm\","
    grep -q '"--privileged",' "$d/provision.go" && grep -q '"--privileged",' "$d/node.go" \
      || { log "kind $KIND_VERSION source changed: no --privileged to replace"; return 1; }
    sed -i "s|\"--privileged\",|$args|" "$d/provision.go"
    sed -i 's|"--privileged",|// --privileged: not on this host; the node container already has its capabilities|' "$d/node.go"
    (cd "$src" && CGO_ENABLED=0 $NICE go build -trimpath -o "$BIN/kind" .)
  fi
  echo "$want" > "$BIN/kind.build"
}

build_node_tools() {
  local t=$NODE_TOOLS
  [ -x "$t/containerd" ] || GOBIN=$t CGO_ENABLED=1 $NICE go install -trimpath \
    -tags "no_aufs no_zfs no_btrfs no_devmapper" -ldflags "-s -w \
      -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"
  # runc links libseccomp (apt: libseccomp-dev); the node image has libseccomp2
  [ -x "$t/runc" ] || GOBIN=$t CGO_ENABLED=1 $NICE go install -trimpath -tags seccomp \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" "github.com/opencontainers/runc@$RUNC_VERSION"
  [ -x "$t/crictl" ] || GOBIN=$t CGO_ENABLED=0 $NICE go install -trimpath -ldflags "-s -w \
    -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
  mkdir -p "$t/cni"
  local p P=github.com/containernetworking/plugins/plugins
  for p in ipam/host-local main/loopback main/ptp meta/portmap; do
    [ -x "$t/cni/$(basename $p)" ] || GOBIN=$t/cni CGO_ENABLED=0 $NICE go install -trimpath -ldflags "-s -w" \
      "$P/$p@$CNI_VERSION"
  done
}

# kubelet, kubeadm, kube-proxy: a builder module like hack/build-control-plane.sh's (same module cache and
# Go build cache, so the packages the control plane shares are not compiled twice).
build_kube_node() {
  local c missing=""
  for c in kubelet kubeadm kube-proxy; do [ -x "$KUBE_BIN/$c" ] || missing="$missing $c"; done
  [ -z "$missing" ] && return 0
  local minor d=$CACHE/build/k8s-node-$K8S_VERSION
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  if [ ! -f "$d/.ready" ]; then
    rm -rf "$d"; mkdir -p "$d"
    (cd "$d"
     printf 'module local/kascade-k8s-node-builder\n\ngo 1.%d.0\ngodebug default=go1.%d\n' $((minor - 10)) $((minor - 10)) > go.mod
     gomodfile=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
     for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomodfile"); do
       go mod edit -replace="$m=$m@v0.${K8S_VERSION#v1.}"
     done
     go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
     go get -tool "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION" "k8s.io/kubernetes/cmd/kubeadm@$K8S_VERSION" \
                  "k8s.io/kubernetes/cmd/kube-proxy@$K8S_VERSION"
     touch .ready)
  fi
  local V=k8s.io/component-base/version
  local ldf="-s -w -X $V.gitVersion=$K8S_VERSION -X $V.gitMajor=1 -X $V.gitMinor=$minor -X $V.gitTreeState=clean"
  for c in $missing; do
    log "go build $c $K8S_VERSION"
    (cd "$d" && CGO_ENABLED=0 $NICE go build -trimpath -ldflags "$ldf" -o "$KUBE_BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c")
    mv "$KUBE_BIN/$c.tmp" "$KUBE_BIN/$c"
  done
}

# The packages kindest/base installs (images/base/Dockerfile), minus network storage (nfs, iscsi).
ROOTFS_PKGS=systemd,systemd-sysv,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,fuse-overlayfs,bash,ca-certificates,curl,jq,procps
build_rootfs() {
  image_exists "$PREFIX/debian:$DEBIAN_SUITE" && return 0
  local r=$WORK/rootfs-$DEBIAN_SUITE
  if [ ! -f "$r.tar" ]; then
    rm -rf "$r"
    $NICE debootstrap --variant=minbase --include="$ROOTFS_PKGS" "$DEBIAN_SUITE" "$r" http://deb.debian.org/debian \
      > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/*
    tar -C "$r" -cf "$r.tar.tmp" . && mv "$r.tar.tmp" "$r.tar" && rm -rf "$r"
  fi
  docker import "$r.tar" "$PREFIX/debian:$DEBIAN_SUITE" >/dev/null
}

build_base() {
  image_exists "$BASE_IMAGE" && return 0
  local ctx=$WORK/base-ctx src
  src=$(moddir "sigs.k8s.io/kind@$KIND_VERSION")/images/base/files
  rm -rf "$ctx"; mkdir -p "$ctx/bin" "$ctx/cni"
  cp -r "$src" "$ctx/files"; chmod -R u+w "$ctx/files"
  cp "$NODE_TOOLS"/{containerd,ctr,containerd-shim-runc-v2,crictl,runc} "$ctx/bin/"
  cp "$NODE_TOOLS"/cni/* "$ctx/cni/"
  cat > "$ctx/entrypoint-unprivileged" <<'EOF'
#!/bin/bash
# kind's entrypoint, after doing what `docker run --privileged` would have: /sys and the cgroup mounts
# writable, /dev/kmsg present (hack/build-kind.sh runs nodes without --privileged where the host's
# capability bounding set makes that fail). A no-op in a privileged container.
set -e
if grep -qE '^sysfs /sys sysfs ro[, ]' /proc/mounts; then mount -o remount,bind,rw /sys; fi
grep ' /sys/fs/cgroup/' /proc/mounts | awk '$4 ~ /(^|,)ro(,|$)/ {print $2}' | while read -r m; do
  mount -o remount,bind,rw "$m"
done
[ -e /dev/kmsg ] || mknod -m 600 /dev/kmsg c 1 11 || true
exec /usr/local/bin/entrypoint "$@"
EOF
  cat > "$ctx/Dockerfile" <<EOF
FROM $PREFIX/debian:$DEBIAN_SUITE
COPY files/usr/local/bin/ /usr/local/bin/
COPY files/kind/ /kind/
COPY files/etc/ /etc/
COPY bin/containerd bin/ctr bin/containerd-shim-runc-v2 bin/crictl /usr/local/bin/
COPY bin/runc /usr/local/sbin/runc
COPY entrypoint-unprivileged /usr/local/bin/
COPY cni/ /opt/cni/bin/
# what kindest/base's RUN does (images/base/Dockerfile); and restrict_oom_score_adj: a pod's OOM score is
# never set below containerd's own (lowering it needs CAP_SYS_RESOURCE, which some hosts do not grant:
# runc init then fails "failed to update /proc/self/oom_score_adj: Permission denied")
RUN chmod 755 /kind /kind/bin /kind/bin/* /usr/local/bin/* /usr/local/sbin/runc /opt/cni/bin/* \\
 && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \\
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \\
    /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \\
    /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \\
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \\
 && ln -sf /usr/lib/systemd/systemd /sbin/init \\
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
 && systemctl mask systemd-binfmt.service \\
 && mkdir -p /etc/kubernetes/manifests \\
 && sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml \\
 && ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \\
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \\
 && containerd --version && runc --version
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint-unprivileged", "/sbin/init" ]
EOF
  DOCKER_BUILDKIT=0 $NICE docker build -q -t "$BASE_IMAGE" "$ctx" >/dev/null 2>"$WORK/base-build.err" \
    || { cat "$WORK/base-build.err" >&2; return 1; }
}

source "$REPO/hack/build-kind-images.sh"

# the node image is current when it carries NODE_KEY; else loaded from its tarball when that was saved
node_current() {
  [ "${FORCE:-}" != 1 ] && [ "$(docker image inspect -f '{{index .Config.Labels "kascade.key"}}' "$NODE_IMAGE" 2>/dev/null)" = "$NODE_KEY" ]
}
load_node() {
  node_current && return 0
  [ "${FORCE:-}" != 1 ] && [ -s "$NODE_TAR" ] || return 0
  docker load -q -i "$NODE_TAR" >/dev/null
  node_current || log "$NODE_TAR did not hold $NODE_IMAGE with key $NODE_KEY: building it"
}
save_node() {
  [ "${FORCE:-}" != 1 ] && [ -s "$NODE_TAR" ] && return 0
  rm -f "$KC"/images/node-*.tar  # other keys
  docker save "$NODE_IMAGE" -o "$NODE_TAR.tmp" && mv "$NODE_TAR.tmp" "$NODE_TAR"
  log "saved $NODE_TAR ($(du -h "$NODE_TAR" | cut -f1))"
}

build_node() {
  node_current && return 0
  local id
  id=$(docker run -d --entrypoint=sleep --security-opt seccomp=unconfined "$BASE_IMAGE" infinity)
  # shellcheck disable=SC2064
  trap "docker rm -f -v $id >/dev/null 2>&1 || true" RETURN
  local c
  for c in kubeadm kubelet kubectl; do
    docker cp "$(kube_binary $c)" "$id:/usr/bin/$c"
  done
  docker exec "$id" chown root:root /usr/bin/kubeadm /usr/bin/kubelet /usr/bin/kubectl
  echo "$K8S_VERSION" | docker exec -i "$id" sh -c 'cat > /kind/version'
  docker exec "$id" mkdir -p /kind/manifests
  docker cp "$WORK/default-cni.yaml" "$id:/kind/manifests/default-cni.yaml"
  docker exec "$id" bash -c 'nohup containerd >/tmp/containerd.log 2>&1 &'
  for _ in $(seq 1 30); do docker exec "$id" ctr version >/dev/null 2>&1 && break; sleep 0.5; done
  # every image kubeadm wants, plus the pod network's, imported and pinned as kind does
  docker save "${CLUSTER_IMAGES[@]}" | docker exec -i "$id" ctr --namespace=k8s.io images import \
    --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack --digests - >/dev/null
  local want have
  want=$(docker exec "$id" kubeadm config images list --kubernetes-version "$K8S_VERSION")
  want="$want $(docker exec "$id" sed -n 's/.*sandbox_image *= *"\(.*\)"/\1/p' /etc/containerd/config.toml)"
  have=$(docker exec "$id" ctr --namespace=k8s.io images list -q)
  for c in $want; do
    echo "$have" | grep -qx "$c" || { log "image $c is not among the built images: $(echo $have)"; return 1; }
  done
  docker exec "$id" pkill containerd || true
  sleep 1
  docker commit --change "LABEL kascade.key=$NODE_KEY" --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint-unprivileged", "/sbin/init" ]' "$id" "$NODE_IMAGE" >/dev/null
}

# What this needs from the system: Docker (a running daemon), debootstrap, libseccomp-dev (runc), a C
# compiler and static libc (pause). Installed with apt when root (CI on a fresh machine), else named.
need_system() {
  local pkgs=()
  command -v docker >/dev/null || pkgs+=(docker.io)
  command -v debootstrap >/dev/null || pkgs+=(debootstrap)
  [ -f /usr/include/seccomp.h ] || pkgs+=(libseccomp-dev)
  command -v gcc >/dev/null || pkgs+=(gcc)
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || pkgs+=(libc6-dev)
  command -v pkg-config >/dev/null || pkgs+=(pkg-config)
  if [ ${#pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "apt-get install ${pkgs[*]}"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
    else
      log "missing: ${pkgs[*]} (install them with your package manager)"; exit 2
    fi
  fi
  if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null && [ "${CI:-}" = true ]; then
      log "starting dockerd (log: $WORK/dockerd.log)"
      nohup dockerd > "$WORK/dockerd.log" 2>&1 &
      for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    fi
    docker info >/dev/null 2>&1 || { log "no Docker daemon answers on ${DOCKER_HOST:-/var/run/docker.sock}"; exit 2; }
  fi
}

# the whole script is read before it runs (editing it mid-build is then harmless)
main() {
  BASE_IMAGE=$BASE_IMAGE-$(declare -f build_base | sha256sum | cut -c1-8)
  NODE_KEY=$({ cat "$REPO/hack/build-kind.sh" "$REPO/hack/build-kind-images.sh"
               echo "$K8S_VERSION $KIND_VERSION $CONTAINERD_VERSION $RUNC_VERSION $CRICTL_VERSION $CNI_VERSION"
               echo "$COREDNS_VERSION $DEBIAN_SUITE"; } | sha256sum | cut -c1-16)
  NODE_TAR=$KC/images/node-$K8S_VERSION-$NODE_KEY.tar
  mkdir -p "$KC/images"
  T0=$SECONDS
  stage system need_system
  stage kind build_kind
  stage node-cache load_node
  if ! node_current; then
    stage node-tools build_node_tools
    stage rootfs build_rootfs
    stage base build_base
    stage kube-node build_kube_node
    stage images build_cluster_images
    stage node build_node
    stage node-save save_node
  fi
  log "all done in $((SECONDS - T0)) s; node image $NODE_IMAGE ($(docker image inspect -f '{{.Size}}' "$NODE_IMAGE" 2>/dev/null | awk '{printf "%.0f MB", $1/1e6}'))"
  echo "$NODE_IMAGE"
}
main "$@"
exit
