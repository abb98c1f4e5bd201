"""Cluster topology: nodes, their GPUs, scale-up (NVLink) domains, leaf switches and bandwidths.

Data flow: Kubernetes Node dicts (labels + `nvidia.com/gpu` capacity) or a YAML/dict topology file ->
`Topology` (frozen) -> `bandwidth_gbps(a, b)` used by every plan builder and the cost model.
Inside a leaf, bandwidth between two GPUs is min of their NICs; across leaves it is scaled by
`inter_leaf_ratio`; inside one scale-up domain it is the NVLink bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class TopologyError(ValueError):
    """Bad topology input; the message names the node and the label or field."""


@dataclass(frozen=True)
class LabelKeys:
    leaf: str = "kascade.io/leaf"
    domain: str = "kascade.io/scaleup-domain"
    nic_gbps: str = "kascade.io/nic-gbps"
    gpu_resource: str = "nvidia.com/gpu"


@dataclass(frozen=True)
class Node:
    name: str
    leaf: str
    domain: str
    gpus: int
    nic_gbps: float  # scale-out bandwidth per GPU


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    inter_leaf_ratio: float = 1.0
    nvlink_gbps: float = 1600.0
    pcie_gbps: float = 128.0  # host memory -> GPU, per GPU
    ssd_gbps: float = 10.0  # local SSD -> GPU, per GPU
    _by_name: Mapping[str, Node] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.inter_leaf_ratio <= 1:
            raise TopologyError(f"interLeafBandwidthRatio must be in (0, 1], got {self.inter_leaf_ratio}")
        by_name: dict[str, Node] = {}
        for n in self.nodes:
            if n.name in by_name:
                raise TopologyError(f"node {n.name!r} appears twice")
            by_name[n.name] = n
        object.__setattr__(self, "_by_name", by_name)

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise TopologyError(f"unknown node {name!r}") from None

    @property
    def by_name(self) -> Mapping[str, Node]:
        return self._by_name

    def bandwidth_gbps(self, a: str, b: str) -> float:
        """Per-GPU bandwidth between nodes `a` and `b` (Gbit/s)."""
        na, nb = self.node(a), self.node(b)
        if na.domain == nb.domain:
            return self.nvlink_gbps
        bw = min(na.nic_gbps, nb.nic_gbps)
        return bw if na.leaf == nb.leaf else bw * self.inter_leaf_ratio

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)


def _label(node: str, labels: Mapping[str, str], key: str) -> str:
    value = labels.get(key)
    if value is None or value == "":
        raise TopologyError(f"node {node!r}: missing label {key!r}")
    return value


def _number(node: str, what: str, raw: object, minimum: float = 0.0) -> float:
    try:
        value = float(str(raw)[:64])
    except ValueError:
        raise TopologyError(f"node {node!r}: {what} must be a number, got {_short(raw)}") from None
    if value < minimum or not math.isfinite(value):
        raise TopologyError(f"node {node!r}: {what} must be a finite number >= {minimum}, got {_short(raw)}")
    return value


def _short(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def field_number(doc: Mapping[str, Any], key: str, where: str, default: float, lo: float, hi: float,
                 integer: bool = False, lo_open: bool = False) -> float:
    """`doc[key]` as a finite number in [lo, hi] ((lo, hi] with `lo_open`); the error names the field."""
    raw = doc.get(key, default)
    try:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError
        value = float(str(raw)[:64])
    except ValueError:
        raise TopologyError(f"{where}{key} must be a number, got {_short(raw)}") from None
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo) \
            or (integer and value != int(value)):
        kind = "an integer" if integer else "a number"
        span = f"in ({lo:g}, {hi:g}]" if lo_open else f"in [{lo:g}, {hi:g}]"
        raise TopologyError(f"{where}{key} must be {kind} {span}, got {_short(raw)}")
    return value


MAX_NODES = 100_000


def topology_from_nodes(nodes: Iterable[Mapping[str, Any]], keys: LabelKeys = LabelKeys(),
                        inter_leaf_ratio: float = 1.0, nvlink_gbps: float = 1600.0) -> Topology:
    """Parse Kubernetes Node objects (as dicts). Nodes without GPUs are skipped. Every GPU node needs the
    leaf and NIC labels (a TopologyError names the node and key); without the domain label a node is its
    own scale-up domain, as in `topology_from_dict`."""
    out = []
    for obj in nodes:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name:
            raise TopologyError("a node has no metadata.name")
        status = obj.get("status") or {}
        cap = (status.get("allocatable") or status.get("capacity") or {})
        gpus = int(_number(name, keys.gpu_resource, cap.get(keys.gpu_resource, 0)))
        if gpus == 0:
            continue
        labels = meta.get("labels") or {}
        nic = _number(name, f"label {keys.nic_gbps!r}", _label(name, labels, keys.nic_gbps), minimum=1e-9)
        # No scale-up-domain label: the node is its own NVLink domain (HGX: NVLink inside one node). GPU
        # feature discovery sets `nvidia.com/gpu.clique` only on multi-node NVLink systems, so a mixed
        # cluster can point the domain key at it and leave the other nodes unlabelled.
        domain = labels.get(keys.domain) or name
        out.append(Node(name, _label(name, labels, keys.leaf), domain, gpus, nic))
    return Topology(tuple(sorted(out, key=lambda n: n.name)), inter_leaf_ratio, nvlink_gbps)


def topology_from_dict(doc: Mapping[str, Any]) -> Topology:
    """Parse a topology document: explicit `nodes:` and/or a `generate:` leaf-spine spec."""
    if not isinstance(doc, Mapping):
        raise TopologyError("topology must be a mapping")
    nodes: list[Node] = []
    raw_nodes = doc.get("nodes") or []
    if not isinstance(raw_nodes, list):
        raise TopologyError(f"nodes must be a list, got {type(raw_nodes).__name__}")
    if len(raw_nodes) > MAX_NODES:
        raise TopologyError(f"nodes: {len(raw_nodes)} entries, at most {MAX_NODES}")
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, Mapping) or "name" not in raw:
            raise TopologyError(f"nodes[{i}]: needs a name")
        name = str(raw["name"])
        for req in ("leaf", "gpus", "nicGbps"):
            if req not in raw:
                raise TopologyError(f"node {name!r}: missing field {req!r}")
        gpus = _number(name, "gpus", raw["gpus"], 1)
        if gpus != int(gpus) or gpus > 1024:
            raise TopologyError(f"node {name!r}: gpus must be an integer in [1, 1024], got {_short(raw['gpus'])}")
        nodes.append(Node(name, str(raw["leaf"]), str(raw.get("domain", name)), int(gpus),
                          _number(name, "nicGbps", raw["nicGbps"], 1e-9)))
    gen = doc.get("generate")
    if gen:
        if not isinstance(gen, Mapping):
            raise TopologyError(f"generate must be a mapping, got {_short(gen)}")
        leaves = int(field_number(gen, "leaves", "generate.", 1, 1, MAX_NODES, integer=True))
        per = int(field_number(gen, "nodesPerLeaf", "generate.", 1, 1, MAX_NODES, integer=True))
        if leaves * per > MAX_NODES:
            raise TopologyError(f"generate: leaves x nodesPerLeaf = {leaves * per} nodes, at most {MAX_NODES}")
        nodes.extend(
            leaf_spine(
                leaves,
                per,
                int(field_number(gen, "gpusPerNode", "generate.", 8, 1, 1024, integer=True)),
                field_number(gen, "nicGbps", "generate.", 100, 0, 1e6, lo_open=True),
                str(gen.get("prefix", "node")),
            ).nodes
        )
    if not nodes:
        raise TopologyError("topology has no nodes (give `nodes:` or `generate:`)")
    return Topology(tuple(nodes), field_number(doc, "interLeafBandwidthRatio", "", 1.0, 0, 1, lo_open=True),
                    field_number(doc, "nvlinkGbps", "", 1600.0, 0, 1e7, lo_open=True),
                    field_number(doc, "pcieGbps", "", 128.0, 0, 1e7, lo_open=True),
                    field_number(doc, "ssdGbps", "", 10.0, 0, 1e7, lo_open=True))


def leaf_spine(leaves: int, nodes_per_leaf: int, gpus_per_node: int = 8, nic_gbps: float = 100.0,
               prefix: str = "node", inter_leaf_ratio: float = 1.0) -> Topology:
    """A regular leaf-spine cluster: one NVLink domain per node."""
    if leaves < 1 or nodes_per_leaf < 1 or gpus_per_node < 1:
        raise TopologyError("leaf_spine needs leaves, nodes_per_leaf, gpus_per_node >= 1")
    nodes = tuple(Node(f"{prefix}-{leaf}-{i}", f"leaf-{leaf}", f"{prefix}-{leaf}-{i}", gpus_per_node, nic_gbps)
                  for leaf in range(leaves) for i in range(nodes_per_leaf))
    return Topology(nodes, inter_leaf_ratio)
