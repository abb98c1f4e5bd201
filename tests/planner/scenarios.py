"""Small scenario builders shared by the planner tests: a leaf-spine topology with a uniform model."""

from __future__ import annotations

from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import Topology, leaf_spine


class Scenario:
    def __init__(self, leaves: int = 2, nodes_per_leaf: int = 4, gpus: int = 8, ratio: float = 1.0) -> None:
        self.topo: Topology = leaf_spine(leaves, nodes_per_leaf, gpus, 100.0, inter_leaf_ratio=ratio)
        self.nodes = [n.name for n in self.topo.nodes]
        self.model = ModelLayout.uniform("m", 8, 8 * 10**9)

    def instances(self, prefix: str, node_idx: list[int], gpus: int = 1) -> list[Instance]:
        return [Instance(f"{prefix}{k}", self.nodes[i], gpus) for k, i in enumerate(node_idx)]
