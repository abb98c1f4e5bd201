"""A planning scenario file: a topology plus what to load where.

Data flow: YAML/dict -> `Scenario` (topology, model layout, sources, targets, KV flows, host caches).
`targets: {count: N, gpus: g}` places N targets round-robin over leaves on nodes without a source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kascade_planner.plan import Instance, ModelLayout, PlanError
from kascade_planner.topology import Topology, TopologyError, topology_from_dict


@dataclass(frozen=True)
class Scenario:
    topology: Topology
    model: ModelLayout
    sources: tuple[Instance, ...]
    targets: tuple[Instance, ...]
    kv_flows: tuple[tuple[str, str], ...] = ()
    host_cached_nodes: tuple[str, ...] = ()


def _instances(raw: object, field: str, topo: Topology) -> list[Instance]:
    if not isinstance(raw, list):
        raise PlanError(f"scenario.{field} must be a list")
    out = []
    for i, d in enumerate(raw):
        if not isinstance(d, Mapping) or "id" not in d or "node" not in d:
            raise PlanError(f"scenario.{field}[{i}]: needs id and node")
        try:
            topo.node(str(d["node"]))
        except TopologyError:
            raise PlanError(f"scenario.{field}[{i}]: unknown node {d['node']!r}") from None
        out.append(Instance(str(d["id"]), str(d["node"]), int(d.get("gpus", 1))))
    return out


def place_targets(topo: Topology, count: int, gpus: int, taken: set[str]) -> list[Instance]:
    by_leaf: dict[str, list[str]] = {}
    for n in topo.nodes:
        if n.name not in taken and n.gpus >= gpus:
            by_leaf.setdefault(n.leaf, []).append(n.name)
    slots = [n for group in zip(*by_leaf.values(), strict=False) for n in group]
    slots += [n for names in by_leaf.values() for n in names[min(map(len, by_leaf.values())):]] if by_leaf else []
    if count > len(slots):
        raise PlanError(f"scenario.targets.count={count} exceeds the {len(slots)} free nodes")
    return [Instance(f"t{i}", slots[i], gpus) for i in range(count)]


def scenario_from_dict(doc: Mapping[str, Any]) -> Scenario:
    topo = topology_from_dict(doc)
    sc = doc.get("scenario")
    if not isinstance(sc, Mapping):
        raise PlanError("missing `scenario:` section (model, sources, targets)")
    m = sc.get("model") or {}
    try:
        layers, size_gb = int(m.get("layers", 32)), float(m.get("sizeGB", 16))
    except (TypeError, ValueError):
        raise PlanError("scenario.model: layers and sizeGB must be numbers") from None
    if layers < 1 or size_gb <= 0:
        raise PlanError("scenario.model: layers must be >= 1 and sizeGB > 0")
    model = ModelLayout.uniform(str(m.get("name", "model")), layers, int(size_gb * 1e9))
    sources = _instances(sc.get("sources"), "sources", topo)
    raw_t = sc.get("targets")
    if isinstance(raw_t, Mapping):
        targets = place_targets(topo, int(raw_t.get("count", 1)), int(raw_t.get("gpus", 1)), {s.node for s in sources})
    else:
        targets = _instances(raw_t, "targets", topo)
    kv = tuple((str(a), str(b)) for a, b in sc.get("kvFlows", []))
    return Scenario(topo, model, tuple(sources), tuple(targets), kv, tuple(str(n) for n in sc.get("hostCachedNodes", [])))
