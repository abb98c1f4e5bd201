"""A planning scenario file: a topology plus what to load where.

Data flow: YAML/dict -> `Scenario` (topology, model layout, sources, targets, KV flows, host caches).
`targets: {count: N, gpus: g}` places N targets round-robin over leaves on nodes without a source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kascade_planner.plan import Instance, ModelLayout, PlanError
from kascade_planner.topology import MAX_NODES, Topology, TopologyError, field_number, topology_from_dict

MAX_LAYERS = 10_000


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
        try:
            gpus = int(field_number(d, "gpus", f"scenario.{field}[{i}].", 1, 1, 1024, integer=True))
        except TopologyError as e:
            raise PlanError(str(e)) from None
        out.append(Instance(str(d["id"]), str(d["node"]), gpus))
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
    if not isinstance(m, Mapping):
        raise PlanError("scenario.model must be a mapping")
    try:
        layers = int(field_number(m, "layers", "scenario.model.", 32, 1, MAX_LAYERS, integer=True))
        size_gb = field_number(m, "sizeGB", "scenario.model.", 16, 0, 1e6, lo_open=True)
    except TopologyError as e:
        raise PlanError(str(e)) from None
    model = ModelLayout.uniform(str(m.get("name", "model")), layers, max(1, int(size_gb * 1e9)))
    sources = _instances(sc.get("sources"), "sources", topo)
    raw_t = sc.get("targets")
    if isinstance(raw_t, Mapping):
        try:
            count = int(field_number(raw_t, "count", "scenario.targets.", 1, 1, MAX_NODES, integer=True))
            gpus = int(field_number(raw_t, "gpus", "scenario.targets.", 1, 1, 1024, integer=True))
        except TopologyError as e:
            raise PlanError(str(e)) from None
        targets = place_targets(topo, count, gpus, {s.node for s in sources})
    else:
        targets = _instances(raw_t, "targets", topo)
    raw_kv = sc.get("kvFlows") or []
    if not isinstance(raw_kv, list) or not all(isinstance(x, list) and len(x) == 2 for x in raw_kv):
        raise PlanError("scenario.kvFlows must be a list of [prefill, decode] pairs")
    kv = tuple((str(a), str(b)) for a, b in raw_kv)
    cached = sc.get("hostCachedNodes") or []
    if not isinstance(cached, list):
        raise PlanError("scenario.hostCachedNodes must be a list of node names")
    return Scenario(topo, model, tuple(sources), tuple(targets), kv, tuple(str(n) for n in cached))
