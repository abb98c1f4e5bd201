"""A tensor-parallel replica as a group of ranks: where its ranks go, and the per-rank planes a plan into it runs.

Concept: a TP-g instance is g ranks (one process and one GPU each, one data port each) on one node, inside one
scale-up domain (their all-reduces and the all-gather run over NVLink). A plan between instances (builder.py) is
run as g *rank planes*: plane r is an ordinary plan whose targets are the targets' rank r (`rank_id`), whose blocks
are rank r's share of every block, and whose flows follow the instance plan's (same chains, same order, same
fallbacks). Two kinds of share:
  "slices" (source and target TP equal): rank r of the source sends rank r of the target exactly the slices that
           rank keeps (`slice_id`, `<block>@r/g`, sized by the source's slice manifest), nothing is gathered;
  "parts"  (TP differs, BlitzScale's case: a TP-1 source into a TP-g target): plane r carries bytes
           `part_range(size, r, g)` of every block (`part_id`, `<block>#r/g`), and the ranks all-gather the
           parts over NVLink, verify each whole block's digest and keep their slices.
Either way one rank ingests ~1/g of the bytes over its own link, so the group loads ~g times faster than the
whole model through one link (`ingest_seconds`: the arithmetic the bench compares against).

Data flow: topology + GPUs in use -> `place_group` (the node of a TP-g replica, or a PlanError naming `tp`) ->
instance plan (builder.make_plan) -> `rank_planes(plan, g, mode, sizes)` -> one `RankPlane` per rank, each a
validated `Plan` the engine's data plane runs as it runs any plan (one TransferNode per rank and plane).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError
from kascade_planner.topology import Topology

Mode = Literal["slices", "parts"]


def rank_id(instance_id: str, rank: int) -> str:
    """The data-plane participant of rank `rank` of instance `instance_id` ("rep-1" rank 1 -> "rep-1.r1")."""
    return f"{instance_id}.r{rank}"


def part_id(block: str, rank: int, g: int) -> str:
    return f"{block}#{rank}/{g}"


def slice_id(block: str, rank: int, g: int) -> str:
    return f"{block}@{rank}/{g}"


def share_id(mode: Mode, block: str, rank: int, g: int) -> str:
    return slice_id(block, rank, g) if mode == "slices" else part_id(block, rank, g)


def whole_of(share: str) -> str:
    """The block a share belongs to ("layer.3#1/2" or "layer.3@1/2" -> "layer.3")."""
    return share.split("@", 1)[0].split("#", 1)[0]


def part_range(size: int, rank: int, g: int) -> tuple[int, int]:
    """Bytes [begin, end) of a block of `size` bytes that plane `rank` of `g` carries (ceil-sized parts, the last
    shorter; the same split as a sharded flow's `shard_range`)."""
    step = math.ceil(size / g)
    return min(size, rank * step), min(size, (rank + 1) * step)


def plane_mode(source_tp: int, target_tp: int) -> Mode:
    return "slices" if source_tp == target_tp else "parts"


def instance_mode(plan: Plan, g: int) -> Mode:
    """How an instance plan into TP-`g` targets runs, as every participant decides it from the plan alone:
    "slices" when every source is a TP-`g` GPU instance (matched TP: rank r of a source sends rank r of a target
    its slices, nothing gathered), else "parts" (a TP-1 source, a host copy: 1/g of every block per rank, then the
    all-gather). A source of another width (neither 1 nor g) is refused: PlanError naming `sources`."""
    odd = sorted({s.gpus for s in plan.sources if s.kind == "gpu" and s.gpus not in (1, g)})
    if odd:
        raise PlanError(f"sources: a plan into TP-{g} targets from sources of {odd[0]} GPUs (only TP 1 or TP {g})")
    if plan.sources and all(s.kind == "gpu" and s.gpus == g for s in plan.sources):
        return "slices"
    return "parts"


def place_group(topo: Topology, tp: int, used: Mapping[str, int]) -> str:
    """The node a TP-`tp` replica's ranks go to: the first node (topology order) with `tp` free GPUs, so every
    rank shares its scale-up domain. A replica never spans nodes: PlanError naming `tp` when none fits."""
    if tp < 1:
        raise PlanError(f"tp: {tp} must be at least 1")
    for n in topo.nodes:
        if n.gpus - used.get(n.name, 0) >= tp:
            return n.name
    most = max((n.gpus - used.get(n.name, 0) for n in topo.nodes), default=0)
    raise PlanError(f"tp: {tp} ranks fit on no node (most free GPUs on one node: {most}); a tensor-parallel "
                    "replica stays inside one node's scale-up domain")


@dataclass(frozen=True)
class RankPlane:
    rank: int
    g: int
    mode: Mode
    plan: Plan


def _rename(i: Instance, rank: int, tp_ids: frozenset[str]) -> Instance:
    if i.id in tp_ids:
        return Instance(rank_id(i.id, rank), i.node, 1, i.kind)
    return i


def plane_plan(plan: Plan, rank: int, g: int, mode: Mode, sizes: Mapping[str, int] | None = None) -> Plan:
    """Plane `rank` of an instance plan into TP-`g` targets (see the module docstring). `sizes`: every share's
    bytes for "slices" (the source's slice manifest: a slice's size depends on the tensors, not the block's);
    "parts" derives them from the block sizes. Sources of width g (matched TP) become their rank `rank`."""
    if not 0 <= rank < g:
        raise PlanError(f"rank: {rank} outside 0..{g - 1}")
    if any(t.gpus != g for t in plan.targets):
        raise PlanError(f"targets: every target must have {g} GPUs, got {sorted({t.gpus for t in plan.targets})}")
    if any(f.shard for f in plan.flows):
        raise PlanError("flows: the instance plan is already sharded; plan planes from the unsharded plan")
    tp_ids = frozenset(i.id for i in (*plan.sources, *plan.targets) if i.gpus == g and i.kind == "gpu")
    ids: list[str] = []
    nbytes: list[int] = []
    for b, size in zip(plan.model.block_ids, plan.model.block_bytes, strict=True):
        sid = share_id(mode, b, rank, g)
        if mode == "parts":
            lo, hi = part_range(size, rank, g)
            n = hi - lo
        elif sizes is None or sid not in sizes:
            raise PlanError(f"sizes: slices mode needs the size of {sid!r} (the source's slice manifest)")
        else:
            n = sizes[sid]
        if n > 0:  # a block smaller than g bytes has empty last parts: nothing to send
            ids.append(sid)
            nbytes.append(n)
    shares = {b: share_id(mode, b, rank, g) for b in plan.model.block_ids}
    keep = set(ids)
    name = {i: rank_id(i, rank) if i in tp_ids else i for i in (*(s.id for s in plan.sources),
                                                                  *(t.id for t in plan.targets))}
    flows: list[Flow] = []
    steps: list[tuple[int, ...]] = []
    for k, f in enumerate(plan.flows):
        blocks = tuple(shares[b] for b in f.blocks if shares[b] in keep)
        if blocks:
            flows.append(Flow(name[f.src], name[f.dst], blocks))
            if plan.steps:  # a step-scheduled plan (binomial): each plane keeps the instance plan's schedule
                steps.append(tuple(st for b, st in zip(f.blocks, plan.steps[k], strict=True) if shares[b] in keep))
    out = Plan(plan.algorithm, ModelLayout(f"{plan.model.name}", tuple(ids), tuple(nbytes)),
               tuple(_rename(s, rank, tp_ids) for s in plan.sources),
               tuple(_rename(t, rank, tp_ids) for t in plan.targets), tuple(flows),
               chains=tuple(tuple(name.get(x, x) for x in c) for c in plan.chains),
               fallbacks=tuple((name[t], tuple(name.get(x, x) for x in fb)) for t, fb in plan.fallbacks),
               notes=(*plan.notes, f"rank plane {rank} of {g} ({mode})"), steps=tuple(steps))
    return out.validate()


def unsharded(plan: Plan) -> Plan:
    """The instance plan engines derive rank planes from, out of a plan sharded over GPU planes (`sharding.py`,
    chains with `shard`): its plane 0, every flow carrying whole blocks. Planned sharded, so its predictions
    (the cost model's, per GPU link plus the all-gather) are those of the rank planes; unsharded plans pass."""
    if not any(f.shard for f in plan.flows):
        return plan
    keep = [k for k, f in enumerate(plan.flows) if f.shard is None or f.shard[0] == 0]
    flows = tuple(Flow(plan.flows[k].src, plan.flows[k].dst, plan.flows[k].blocks) for k in keep)
    steps = tuple(plan.steps[k] for k in keep) if plan.steps else ()
    return replace(plan, flows=flows, steps=steps,
                   notes=(*plan.notes, "engines run it as one rank plane per GPU (tpgroup.rank_planes)")).validate()


def rank_planes(plan: Plan, g: int, mode: Mode, sizes: Mapping[str, int] | None = None) -> tuple[RankPlane, ...]:
    """Every rank's plane of `plan` (see `plane_plan`)."""
    return tuple(RankPlane(r, g, mode, plane_plan(plan, r, g, mode, sizes)) for r in range(g))


def ingest_seconds(model_bytes: int, g: int, link_gbps: float, nvlink_gbps: float, sharded: bool) -> float:
    """Predicted time for a TP-`g` target to hold every block, from one source copy streaming at `link_gbps` per
    link: unsharded, the whole model crosses one link; sharded ("parts"), each rank's link carries 1/g at once
    and the all-gather adds (g-1)/g of the model over NVLink per rank."""
    if g < 1 or link_gbps <= 0 or nvlink_gbps <= 0:
        raise PlanError(f"g, link_gbps, nvlink_gbps must be positive, got {g}, {link_gbps}, {nvlink_gbps}")
    bits = model_bytes * 8 / 1e9
    if not sharded or g == 1:
        return bits / link_gbps
    return bits / g / link_gbps + bits * (g - 1) / g / nvlink_gbps
