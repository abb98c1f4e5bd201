# shellcheck shell=bash
# Sourced by hack/build-kind.sh: the images a kind cluster runs, built here because no registry is
# reachable. Each is tagged with the exact name kubeadm (`kubeadm config images list`) or containerd's
# sandbox_image asks for, so nothing is ever pulled:
#   kube-apiserver, kube-controller-manager, kube-scheduler, etcd  FROM scratch + the Go binary
#   kube-proxy   the Debian rootfs (iptables, conntrack, nft) + the binary
#   pause        kubernetes' own pause.c, linked statically
#   CoreDNS      github.com/coredns/coredns built with Go (COREDNS_VERSION; tagged as kubeadm's version)
#   podnet       the pod network (kindnet's source is not on the Go module proxy): a DaemonSet that
#                writes each node's ptp/host-local CNI config for its podCIDR and routes every other
#                node's podCIDR via that node's IP - pod IPs are routed, not NATed, between nodes.
PODNET_IMAGE=$PREFIX/podnet:v1
CLUSTER_IMAGES=()

# where a Kubernetes binary is: the node builds here, the control plane from hack/build-control-plane.sh
kube_binary() {
  local f
  for f in "$KUBE_BIN/$1" "$CACHE"/bin/k8s-"$K8S_VERSION"-*/"$1"; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  log "$1 $K8S_VERSION not built: run hack/build-control-plane.sh first"; return 1
}

build_coredns() {
  [ -x "$KC/coredns-$COREDNS_VERSION/coredns" ] && return 0
  GOBIN=$KC/coredns-$COREDNS_VERSION CGO_ENABLED=0 $NICE go install -trimpath -ldflags "-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION"
}

build_pause() {
  [ -x "$KC/pause/pause" ] && return 0
  local src
  src=$(moddir "k8s.io/kubernetes@$K8S_VERSION")/build/pause/linux/pause.c
  mkdir -p "$KC/pause"
  gcc -Os -static -Wall -Werror -DVERSION="$1" -o "$KC/pause/pause" "$src"
}

docker_image() {  # tag, context dir (with its Dockerfile): builds unless cached, records the tag
  CLUSTER_IMAGES+=("$1")
  image_exists "$1" && return 0
  DOCKER_BUILDKIT=0 $NICE docker build -q -t "$1" "$2" >/dev/null 2>"$WORK/image-build.err" \
    || { cat "$WORK/image-build.err" >&2; return 1; }
}

write_podnet() {  # context dir
  cat > "$1/podnet.sh" <<'EOF'
#!/bin/bash
# This node's CNI config for its podCIDR, and a route to every other node's podCIDR via its IP.
set -u
conf=/etc/cni/net.d/10-podnet.conflist
while true; do
  kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' \
    > /tmp/nodes || { sleep 2; continue; }
  while read -r name cidr ip; do
    [ -n "$cidr" ] && [ -n "$ip" ] || continue
    if [ "$name" = "$NODE_NAME" ]; then
      printf '{"cniVersion":"0.4.0","name":"podnet","plugins":[{"type":"ptp","ipMasq":false,"mtu":1500,"ipam":{"type":"host-local","dataDir":"/run/cni-ipam-state","routes":[{"dst":"0.0.0.0/0"}],"ranges":[[{"subnet":"%s"}]]}},{"type":"portmap","capabilities":{"portMappings":true}}]}\n' "$cidr" > /tmp/conf
      cmp -s /tmp/conf "$conf" || { cp /tmp/conf "$conf.tmp" && mv "$conf.tmp" "$conf" && echo "wrote $conf for $cidr"; }
    else
      ip route replace "$cidr" via "$ip" && true
    fi
  done < /tmp/nodes
  sleep 5
done
EOF
  cat > "$WORK/default-cni.yaml" <<EOF
# The pod network (hack/build-kind-images.sh, podnet): kind applies this at cluster creation.
apiVersion: v1
kind: ServiceAccount
metadata: {name: podnet, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: podnet}
rules: [{apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: podnet}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: podnet}
subjects: [{kind: ServiceAccount, name: podnet, namespace: kube-system}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: podnet, namespace: kube-system, labels: {app: podnet}}
spec:
  selector: {matchLabels: {app: podnet}}
  template:
    metadata: {labels: {app: podnet}}
    spec:
      hostNetwork: true
      serviceAccountName: podnet
      priorityClassName: system-node-critical
      tolerations: [{operator: Exists}]
      containers:
      - name: podnet
        image: $PODNET_IMAGE
        imagePullPolicy: Never
        env:
        - {name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
        - {name: POD_SUBNET, value: "{{ .PodSubnet }}"}
        resources: {requests: {cpu: 10m, memory: 20Mi}}
        securityContext: {capabilities: {add: [NET_ADMIN]}}
        volumeMounts: [{name: cni-cfg, mountPath: /etc/cni/net.d}]
      volumes: [{name: cni-cfg, hostPath: {path: /etc/cni/net.d}}]
EOF
}

build_cluster_images() {
  local want img name ctx=$WORK/images c pause_version
  want=$("$(kube_binary kubeadm)" config images list --kubernetes-version "$K8S_VERSION")
  rm -rf "$ctx"; mkdir -p "$ctx"
  for img in $want; do
    name=${img##*/}; name=${name%%:*}
    mkdir -p "$ctx/$name"
    case $name in
      kube-apiserver|kube-controller-manager|kube-scheduler|etcd)
        cp "$(kube_binary "$name")" "$ctx/$name/"
        printf 'FROM scratch\nCOPY %s /usr/local/bin/%s\nENV PATH=/usr/local/bin\n' "$name" "$name" > "$ctx/$name/Dockerfile" ;;
      kube-proxy)
        cp "$(kube_binary kube-proxy)" "$ctx/$name/"
        printf 'FROM %s\nCOPY kube-proxy /usr/local/bin/kube-proxy\n' "$PREFIX/debian:$DEBIAN_SUITE" > "$ctx/$name/Dockerfile" ;;
      coredns)
        build_coredns; cp "$KC/coredns-$COREDNS_VERSION/coredns" "$ctx/$name/"
        printf 'FROM scratch\nCOPY coredns /coredns\nENTRYPOINT ["/coredns"]\n' > "$ctx/$name/Dockerfile" ;;
      pause)
        pause_version=${img##*:}; build_pause "$pause_version"; cp "$KC/pause/pause" "$ctx/$name/"
        printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$ctx/$name/Dockerfile" ;;
      *) log "kubeadm wants $img, which this script does not know how to build"; return 1 ;;
    esac
    docker_image "$img" "$ctx/$name"
  done
  # kind's containerd config names its own sandbox image (registry.k8s.io/pause:3.10): the same pause
  c=$(sed -n 's/.*sandbox_image *= *"\(.*\)"/\1/p' "$(moddir "sigs.k8s.io/kind@$KIND_VERSION")/images/base/files/etc/containerd/config.toml")
  if [ -n "$c" ] && ! echo "$want" | grep -qx "$c"; then
    docker tag "$(echo "$want" | grep '/pause:')" "$c"; CLUSTER_IMAGES+=("$c")
  fi
  mkdir -p "$ctx/podnet"; write_podnet "$ctx/podnet"
  cp "$(kube_binary kubectl)" "$ctx/podnet/"
  printf 'FROM %s\nCOPY kubectl podnet.sh /usr/local/bin/\nENTRYPOINT ["/bin/bash", "/usr/local/bin/podnet.sh"]\n' \
    "$PREFIX/debian:$DEBIAN_SUITE" > "$ctx/podnet/Dockerfile"
  docker_image "$PODNET_IMAGE" "$ctx/podnet"
}
