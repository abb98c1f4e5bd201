"""The kind cluster the in-pod e2e runs on: real kubelets, a real pod network, our images in pods.

Data flow: `hack/build-kind.sh` (run by `make e2e-kind`) builds kind, the node image and every cluster
image here -> `kind_cluster` creates one control plane + two workers from it (the tiny test model on the
host is /models on every worker), gives the workers fake GPUs (an extended resource) and leaf labels,
routes the Service and pod CIDRs from this host through the control-plane node (so the test reaches
the router's Service at its ClusterIP, as a pod would) and loads our images -> `release` installs the
chart with the operator, router and pool on, in a namespace Pod Security `restricted` enforces.
Absent Docker or the built images: skipped with the reason (failed under CI=true).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kascade_demo.kindcluster import KindError, load_image
from kascade_devcluster.requirement import unavailable

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KASCADE_CACHE", Path.home() / ".cache" / "kascade"))
KIND_BIN = CACHE / "kind" / "bin" / "kind"
NODE_IMAGE = os.environ.get("KASCADE_KIND_NODE_IMAGE", "kascade-kind/node:v1.36.3")
# the engine image (make images; it carries the operator and router too), loaded as kascade:e2e (the
# name e2e/kind/values.yaml and modelservice.yaml use); the operator image runs the operator and router
ENGINE_IMAGE = os.environ.get("KASCADE_KIND_ENGINE_IMAGE", "ghcr.io/kascade/kascade-engine:0.1.0-cpu")
OPERATOR_IMAGE = os.environ.get("KASCADE_KIND_OPERATOR_IMAGE", "ghcr.io/kascade/kascade-operator:0.1.0")
E2E_IMAGE = "kascade:e2e"
CLUSTER = os.environ.get("KASCADE_KIND_CLUSTER", "kascade-e2e")
# the engine image goes to one worker only, and the pool with it (ENGINE_NODE): a second ~6 GB copy does
# not fit on the dev machines' disks; the operator and router run on both workers
ENGINE_NODE = os.environ.get("KASCADE_KIND_ENGINE_NODE", f"{CLUSTER}-worker")
MODELS = Path("/tmp/kascade-kind-models")
NS = "kascade"
SERVICE_CIDR, POD_CIDR = "10.96.0.0/16", "10.244.0.0/16"  # kind's defaults


def _run(*args: str, input: str | None = None, check: bool = True, timeout: float = 600) -> str:
    p = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])}... exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p.stdout


def _docker_ok() -> str | None:
    if not shutil.which("docker"):
        return "docker is not installed"
    p = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"no Docker daemon answers: {p.stderr.strip()[:200]}"


def _image_ok(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


@dataclass
class Kind:
    """A kind cluster: kubectl and helm bound to its kubeconfig."""

    name: str
    kubeconfig: Path
    bins: Path
    no_engine: str = ""  # why the engine image is not on ENGINE_NODE ("" when it is)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300) -> str:
        return _run(str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args, input=input,
                    check=check, timeout=timeout)

    def helm(self, *args: str, timeout: float = 600) -> str:
        return _run(str(self.bins / "helm"), f"--kubeconfig={self.kubeconfig}", *args, timeout=timeout)

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def nodes(self, role: str = "worker") -> list[str]:
        sel = "!node-role.kubernetes.io/control-plane" if role == "worker" else "node-role.kubernetes.io/control-plane"
        return self.kubectl("get", "nodes", "-l", sel, "-o", "name").replace("node/", "").split()


def _tiny_model() -> None:
    from kascade_engine.weights.checkpoint import tiny_llama

    if not (MODELS / "tiny-kind" / "config.json").exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        tiny_llama(MODELS / "tiny-kind", layers=8, hidden=256, vocab=2048)
    for p in [MODELS, *MODELS.rglob("*")]:  # the engine runs as uid 65532
        p.chmod(0o755 if p.is_dir() else 0o644)


def engine_load(image: str, node: str) -> str:
    """Load the engine image onto `node` if the disk can take it (kindcluster.load_image); else say why not."""
    try:
        load_image(image, node)
    except KindError as e:
        return f"the engine image {ENGINE_IMAGE} was not loaded: {e}"
    return ""


def _host_routes(cp_ip: str, add: bool, node_cidrs: dict[str, str] | None = None) -> None:
    """Services through the control-plane node (its kube-proxy), each node's pod CIDR through that node: a
    pod's connection to this host (the install walk's Hub) is answered straight back to its node; through the
    control plane, the reply met a conntrack with no SYN there (INVALID, dropped by kube-proxy's rules)."""
    for cidr, via in ((SERVICE_CIDR, cp_ip), (POD_CIDR, cp_ip), *(node_cidrs or {}).items()):
        _run("ip", "route", "replace" if add else "del", cidr, *(["via", via] if add else []), check=add)


def _node_cidrs(k: Kind) -> dict[str, str]:
    nodes = k.get("nodes")["items"]
    return {n["spec"]["podCIDR"]: next(a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP")
            for n in nodes if n["spec"].get("podCIDR")}


@pytest.fixture(scope="session")
def kind_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kind]:
    why = _docker_ok()
    if why:
        unavailable(why)
    bins = Path(os.environ.get("KASCADE_KIND_BINS", CACHE / "bin" / "current"))  # kubectl and helm
    for need, hint in ((KIND_BIN, "hack/build-kind.sh"), (bins / "helm", "hack/build-control-plane.sh")):
        if not need.exists():
            unavailable(f"{need} not built: run {hint} (make e2e-kind does)")
    for img, hint in ((NODE_IMAGE, "hack/build-kind.sh"), (ENGINE_IMAGE, "make images"),
                      (OPERATOR_IMAGE, "make images")):
        if not _image_ok(img):
            unavailable(f"image {img} not built: run {hint} (make e2e-kind does)")
    _tiny_model()
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    kind = [str(KIND_BIN), "--name", CLUSTER]
    reuse = os.environ.get("KASCADE_KIND_REUSE") == "1" and CLUSTER in _run(str(KIND_BIN), "get", "clusters")
    t0 = time.monotonic()
    if not reuse:
        _run(str(KIND_BIN), "delete", "cluster", "--name", CLUSTER, check=False)
        _run(*kind[:1], "create", "cluster", *kind[1:], "--image", NODE_IMAGE,
             "--config", str(REPO / "e2e" / "kind" / "kind-config.yaml"), "--wait", "180s",
             "--kubeconfig", str(kubeconfig), timeout=900)
    else:
        kubeconfig.write_text(_run(str(KIND_BIN), "get", "kubeconfig", "--name", CLUSTER))
    k = Kind(CLUSTER, kubeconfig, bins)
    print(f"\nkind: cluster {CLUSTER} up in {time.monotonic() - t0:.0f} s")
    cp_ip = _run("docker", "inspect", "-f", "{{.NetworkSettings.Networks.kind.IPAddress}}",
                 f"{CLUSTER}-control-plane").strip()
    cidrs = _node_cidrs(k)
    _host_routes(cp_ip, add=True, node_cidrs=cidrs)
    try:
        for i, node in enumerate(k.nodes()):
            k.kubectl("label", "node", node, f"kascade.io/leaf=leaf-{i % 2}", f"kascade.io/scaleup-domain={node}",
                      "kascade.io/nic-gbps=100", "--overwrite")
            k.kubectl("patch", "node", node, "--subresource=status", "--type=json",
                      "-p", '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"4"}]')
        t1 = time.monotonic()
        _run("docker", "tag", ENGINE_IMAGE, E2E_IMAGE)
        # the nodes at once (each load is mostly the node's containerd writing and unpacking layers), but one
        # image after the other into a node: load_image drops an image's layer blobs once it is unpacked, and
        # the images share their base layers, which another import into the same node may still be reading
        def node_loads(node: str) -> str:
            load_image(OPERATOR_IMAGE, node)  # not the control plane
            return engine_load(E2E_IMAGE, node) if node == ENGINE_NODE else ""

        with ThreadPoolExecutor() as pool:
            reasons = [f.result() for f in [pool.submit(node_loads, node) for node in k.nodes()]]
            k.no_engine = "".join(reasons)
        print(f"kind: images loaded in {time.monotonic() - t1:.0f} s")
        yield k
    finally:
        _host_routes(cp_ip, add=False, node_cidrs=cidrs)
        if os.environ.get("KEEP") != "1":
            _run(str(KIND_BIN), "delete", "cluster", "--name", CLUSTER, check=False)
