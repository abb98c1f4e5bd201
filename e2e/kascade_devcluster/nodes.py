"""Fake GPU nodes through KWOK, with Kascade's topology labels and `nvidia.com/gpu` capacity.

Data flow: a `NodeSpec` list -> Node manifests (KWOK annotation + NoSchedule taint so only pods that
tolerate it land there) -> `kubectl apply` -> wait for Ready (KWOK's node-initialize stage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kascade_devcluster.controlplane import ControlPlane

KWOK_KEY = "kwok.x-k8s.io/node"
FAKE_SET_LABEL = "kascade.io/fake-set"
KWOK_TOLERATION = {"key": KWOK_KEY, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int = 8
    leaf: str = "leaf-0"
    domain: str = ""  # scale-up (NVLink) domain; defaults to the node name
    nic_gbps: int = 100


def topology_specs(
    n: int, gpus: int = 8, leaves: int = 2, prefix: str = "gpu-node", nic_gbps: int = 100
) -> list[NodeSpec]:
    """`n` nodes spread round-robin over `leaves` leaf switches, one NVLink domain per node."""
    if n < 0 or gpus < 0 or leaves < 1:
        raise ValueError(f"need n >= 0, gpus >= 0, leaves >= 1 (got n={n}, gpus={gpus}, leaves={leaves})")
    return [NodeSpec(f"{prefix}-{i}", gpus, f"leaf-{i % leaves}", f"{prefix}-{i}", nic_gbps) for i in range(n)]


def node_manifest(spec: NodeSpec, fake_set: str) -> dict[str, object]:
    cap = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(spec.gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "annotations": {KWOK_KEY: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": spec.name,
                "kubernetes.io/os": "linux",
                "type": "kwok",
                "kascade.io/leaf": spec.leaf,
                "kascade.io/scaleup-domain": spec.domain or spec.name,
                "kascade.io/nic-gbps": str(spec.nic_gbps),
                FAKE_SET_LABEL: fake_set,
            },
        },
        "spec": {"taints": [{"key": KWOK_KEY, "value": "fake", "effect": "NoSchedule"}]},
        "status": {"capacity": cap, "allocatable": cap},
    }


def create_nodes(cp: ControlPlane, specs: list[NodeSpec], fake_set: str = "default", timeout_s: int = 60) -> list[str]:
    """Create the nodes and wait until every one is Ready. Returns their names."""
    if not specs:
        return []
    doc = {"apiVersion": "v1", "kind": "List", "items": [node_manifest(s, fake_set) for s in specs]}
    cp.kubectl("apply", "-f", "-", input=json.dumps(doc))
    cp.kubectl("wait", "--for=condition=Ready", "node", "-l", f"{FAKE_SET_LABEL}={fake_set}", f"--timeout={timeout_s}s")
    return [s.name for s in specs]


def delete_nodes(cp: ControlPlane, fake_set: str) -> None:
    cp.kubectl("delete", "node", "-l", f"{FAKE_SET_LABEL}={fake_set}", "--wait=false", check=False)
