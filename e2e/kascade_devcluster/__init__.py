"""A real, local Kubernetes control plane for tests and demos (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, KWOK) run as plain processes on loopback.

Binaries come from `hack/build-control-plane.sh` (Go module proxy, cached by version).
"""
