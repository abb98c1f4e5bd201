"""Baselines to compare against: star (every target pulls from one source), binary tree (FaaSNet),
and local loading from a host-memory cache or SSD on the target's own node (ServerlessLLM)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError


def _check(sources: Sequence[Instance], targets: Sequence[Instance]) -> tuple[list[Instance], list[Instance]]:
    if not sources or not targets:
        raise PlanError("a plan needs at least one source and one target")
    return sorted(sources, key=lambda s: s.id), sorted(targets, key=lambda t: t.id)


def build_star(model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance]) -> Plan:
    srcs, tgts = _check(sources, targets)
    flows = tuple(Flow(srcs[0].id, t.id, model.block_ids) for t in tgts)
    return Plan("star", model, tuple(srcs), tuple(tgts), flows, tuple((srcs[0].id, t.id) for t in tgts),
                tuple((t.id, (srcs[0].id,)) for t in tgts))


def build_tree(model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance]) -> Plan:
    """Binary tree rooted at the first source, targets in BFS order; blocks pipelined down the tree."""
    srcs, tgts = _check(sources, targets)
    nodes = [srcs[0], *tgts]
    flows = tuple(Flow(nodes[(i - 1) // 2].id, nodes[i].id, model.block_ids) for i in range(1, len(nodes)))
    return Plan("tree", model, tuple(srcs), tuple(tgts), flows, (),
                tuple((t.id, (srcs[0].id,)) for t in tgts))


def build_local(model: ModelLayout, targets: Sequence[Instance], host_cached_nodes: Collection[str] = ()) -> Plan:
    """Each target loads from its own node: host memory where cached, else the local SSD. Every GPU
    loads over its own PCIe / SSD link, in parallel: a tp=g target reads g shards (one per GPU, then
    all-gathered over NVLink), and targets sharing a node do not queue behind each other (the cost
    model gives a local read the receiving GPU's link, not one queue per source)."""
    if not targets:
        raise PlanError("a plan needs at least one target")
    tgts = sorted(targets, key=lambda t: t.id)
    srcs: dict[str, Instance] = {}
    flows: list[Flow] = []
    for t in tgts:
        kind: Literal["host", "ssd"] = "host" if t.node in host_cached_nodes else "ssd"
        src = srcs.setdefault(f"{kind}:{t.node}", Instance(f"{kind}:{t.node}", t.node, 1, kind))
        if t.gpus > 1:
            flows.extend(Flow(src.id, t.id, model.block_ids, (i, t.gpus)) for i in range(t.gpus))
        else:
            flows.append(Flow(src.id, t.id, model.block_ids))
    return Plan("local", model, tuple(sorted(srcs.values(), key=lambda s: s.id)), tuple(tgts), tuple(flows))
