"""A kind cluster built here (hack/build-kind.sh), as `make demo-kind` uses it: create or reuse it, give the
workers fake GPUs and leaf labels, load our images into the nodes' containerd, and run kubectl and helm
against it.

Data flow: the kind binary and node image in ~/.cache/kascade/kind -> `KindCluster.create()` (one
control plane, two workers; e2e/kind/kind-config.yaml mounts the host's model directory as /models on the
workers) -> `label_workers()` -> `load()` per image and node (`docker save` streamed into the node's
`ctr images import`, then the layer blobs dropped: the unpacked snapshots are what containers run from)
-> `kubectl()` / `helm()` with the cluster's own kubeconfig. tests/kind/conftest.py does the same for the
kind e2e.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KASCADE_CACHE", Path.home() / ".cache" / "kascade"))
KIND_BIN = CACHE / "kind" / "bin" / "kind"
NODE_IMAGE = os.environ.get("KASCADE_KIND_NODE_IMAGE", "kascade-kind/node:v1.36.3")
MODELS = Path("/tmp/kascade-kind-models")  # e2e/kind/kind-config.yaml: /models on every worker


class KindError(RuntimeError):
    """A step against the kind cluster failed; the message says which and why."""


def run(*args: str, input: str | None = None, check: bool = True, timeout: float = 600) -> str:
    p = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise KindError(f"{' '.join(args[:5])} ... exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    return p.stdout


def missing() -> list[str]:
    """What `make demo-kind` must build first (empty: nothing)."""
    out = []
    if not shutil.which("docker") or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        out.append("a running Docker daemon (hack/docker-up.sh)")
    if not KIND_BIN.exists():
        out.append(f"kind at {KIND_BIN} (hack/build-kind.sh)")
    elif not image_present(NODE_IMAGE):
        out.append(f"the node image {NODE_IMAGE} (hack/build-kind.sh)")
    for b in ("kubectl", "helm"):
        if not (CACHE / "bin" / "current" / b).exists():
            out.append(f"{b} in {CACHE / 'bin' / 'current'} (hack/build-control-plane.sh)")
    return out


def image_present(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def has_image(image: str, node: str) -> bool:
    ref = image if "/" in image.split(":")[0] else f"docker.io/library/{image}"
    return ref in run("docker", "exec", node, "ctr", "-n", "k8s.io", "images", "ls", "-q", check=False).split()


def load_image(image: str, node: str) -> None:
    """Our image into one kind node's containerd, without keeping a second copy of its layers there:
    `docker save` streams into the node's containerd, which unpacks it, and the layer blobs are then dropped
    (the snapshots are what containers run from). Load one image after the other into a node: the images
    share base layers, which another import into the same node may still be reading. KindError when
    Docker's disk cannot take the node's blobs and unpacked snapshot at the peak, with a 2 GB margin
    (KASCADE_KIND_DISK_MARGIN_GB)."""
    if has_image(image, node):
        return
    size = json.loads(run("docker", "image", "inspect", image))[0]["Size"]
    free = shutil.disk_usage(run("docker", "info", "-f", "{{.DockerRootDir}}").strip()).free
    margin = int(os.environ.get("KASCADE_KIND_DISK_MARGIN_GB", "2")) * 2**30
    if free < 2 * size + margin:
        raise KindError(f"loading {image} ({size / 1e9:.2f} GB) into {node} needs ~{(2 * size + margin) / 1e9:.0f} GB "
                        f"free on Docker's disk; {free / 1e9:.1f} GB are")
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    try:
        imp = subprocess.run(["docker", "exec", "-i", node, "ctr", "-n", "k8s.io", "images", "import",
                              "--digests", "--snapshotter=overlayfs", "-"], stdin=save.stdout,
                             capture_output=True, text=True, timeout=1800)
    finally:
        save.wait()
    if imp.returncode != 0 or save.returncode != 0:
        raise KindError(f"loading {image} into {node}: {imp.stderr[-1000:]}")
    layers = json.loads(run("docker", "image", "inspect", image))[0]["RootFS"]["Layers"]
    run("docker", "exec", node, "ctr", "-n", "k8s.io", "content", "rm", *layers, check=False)


@dataclass
class KindCluster:
    name: str
    kubeconfig: Path
    bins: Path = CACHE / "bin" / "current"

    def exists(self) -> bool:
        return self.name in run(str(KIND_BIN), "get", "clusters").split()

    def create(self) -> bool:
        """Create the cluster, or reuse one of this name; True when it was created now."""
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        if self.exists():
            self.kubeconfig.write_text(run(str(KIND_BIN), "get", "kubeconfig", "--name", self.name))
            return False
        run(str(KIND_BIN), "create", "cluster", "--name", self.name, "--image", NODE_IMAGE,
            "--config", str(REPO / "e2e" / "kind" / "kind-config.yaml"), "--wait", "180s",
            "--kubeconfig", str(self.kubeconfig), timeout=900)
        return True

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300) -> str:
        return run(str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args, input=input, check=check,
                   timeout=timeout)

    def helm(self, *args: str, timeout: float = 900) -> str:
        return run(str(self.bins / "helm"), f"--kubeconfig={self.kubeconfig}", *args, timeout=timeout)

    def workers(self) -> list[str]:
        out = self.kubectl("get", "nodes", "-l", "!node-role.kubernetes.io/control-plane", "-o", "name")
        return out.replace("node/", "").split()

    def label_workers(self, gpus: int = 4) -> dict[str, str]:
        """Fake GPUs (an extended resource in each worker's status) and the topology labels the operator
        plans with; returns node -> leaf."""
        leaf_of = {}
        for i, node in enumerate(self.workers()):
            leaf_of[node] = f"leaf-{i % 2}"
            self.kubectl("label", "node", node, f"kascade.io/leaf={leaf_of[node]}",
                         f"kascade.io/scaleup-domain={node}", "kascade.io/nic-gbps=100", "--overwrite")
            self.kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p",
                         json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(gpus)}]))
        return leaf_of

    def load(self, image: str, node: str) -> None:
        load_image(image, node)

    def delete(self) -> None:
        run(str(KIND_BIN), "delete", "cluster", "--name", self.name, check=False)


def tiny_model(name: str = "tiny-kind") -> Path:
    """The random 8-layer Llama the kind story serves, in the directory kind mounts into the workers."""
    from kascade_engine.weights.checkpoint import tiny_llama

    if not (MODELS / name / "config.json").exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        tiny_llama(MODELS / name, layers=8, hidden=256, vocab=2048)
    for p in [MODELS, *MODELS.rglob("*")]:  # the engines run as uid 65532
        p.chmod(0o755 if p.is_dir() else 0o644)
    return MODELS / name
