"""Multicast mode `auto`: build the candidate plans, keep the fastest predicted, and say why.

Data flow: (topology, model, sources, targets) -> candidates: chains (always), hybrid striped trees
with f in {2, 4} stripes (f >= the spine's oversubscription, so a cross-leaf stripe is never slower
than a stripe's share of a link), the λScale binomial pipeline (up to `BINOMIAL_MAX` targets: its
schedule is built step by step) -> a predicted completion for each -> the minimum, ties to the
simpler plan (chain, then hybrid, then binomial) -> that plan, with a note listing every score.
Up to `EXACT_MAX` targets every candidate is built and predicted by the cost model itself. Beyond,
candidates are scored by closed forms of the same model (`estimate_*`, checked against it by tests;
the cost model itself where a plan breaks the closed form's premise), and a chain plan is not even
built when its pipeline fill alone is longer than the best hybrid: planning 2,048 targets stays
within milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import compress, pairwise
from operator import ne

from kascade_planner.binomial import build_binomial
from kascade_planner.chains import ChainOptions, build_chains
from kascade_planner.cost import CostParams, pair_gbps, predict
from kascade_planner.hybrid import build_hybrid
from kascade_planner.plan import Instance, ModelLayout, Plan, PlanError, runs
from kascade_planner.sharding import plane_width, shard_plan
from kascade_planner.topology import Topology

EXACT_MAX = 256
BINOMIAL_MAX = 32


def stripe_options(topo: Topology, exact: bool = True) -> tuple[int, ...]:
    """Stripe counts worth trying: 2, and enough that one cross-leaf stripe fits a link's uplink
    share (ceil(1 / inter-leaf ratio)); with exact scoring also 4."""
    need = math.ceil(1 / topo.inter_leaf_ratio - 1e-9)
    return tuple(sorted({2, max(2, need), *((4,) if exact else ())}))


def estimate_chain(plan: Plan, topo: Topology, cost: CostParams) -> float:
    """Each chain: the model at its slowest hop's rate, plus one chunk time per further hop."""
    inst = {i.id: i for i in (*plan.sources, *plan.targets)}
    sharded = {f.dst for f in plan.flows if f.shard}
    total = plan.model.total_bytes
    worst = 0.0
    for chain in plan.chains:
        rates = []
        for a, b in pairwise(chain):
            src, dst = inst[a], inst[b]
            g = dst.gpus if b in sharded else 1
            rates.append(pair_gbps(topo, src, dst) * g * 1e9 / 8)
        if rates:
            slow = min(rates)
            worst = max(worst, total / slow + sum(min(cost.chunk_bytes, total) / r for r in rates[1:])
                        + cost.hop_latency_s * len(rates))
    return worst


def chain_floor(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
                cost: CostParams) -> float:
    """No chain plan finishes sooner: at most one chain per source, so some chain has at least
    ceil(targets / sources) targets, each hop one chunk time behind the previous at the best link rate."""
    by_name = topo.by_name
    n = math.ceil(len(targets) / max(1, len(sources)))
    bw = max([by_name[i.node].nic_gbps * i.gpus for i in targets]) * 1e9 / 8
    return model.total_bytes / bw + (n - 1) * min(cost.chunk_bytes, max(model.block_bytes)) / bw


def estimate_hybrid(plan: Plan, topo: Topology, cost: CostParams) -> float | None:
    """When every link carries its even share (no target forwards more than f flows, no link more
    cross-leaf flows than its uplink share), every stripe flow runs at link/f: the last target
    finishes one stripe's bytes plus one chunk per hop of its deepest stripe after the start, at
    that rate. Shard planes (g-way sharded flows) are identical copies over each GPU's own link: one
    plane is scored with 1/g of the bytes, plus the NVLink all-gather. None when the plan breaks the
    promise (the caller then runs the cost model)."""
    g = plan.flows[0].shard[1] if plan.flows and plan.flows[0].shard else 1
    flows = plan.flows
    if any([f.shard for f in flows]):
        flows = tuple(f for f in flows if not f.shard or f.shard[0] == 0)
    # Thousands of flows: walk them as parallel columns (C-level map and Counter do most of the work),
    # and per run of one stripe's flows (builders share one blocks tuple per stripe: its id is the key).
    srcs, dsts, keys = [f.src for f in flows], [f.dst for f in flows], [id(f.blocks) for f in flows]
    sources = {s.id for s in plan.sources}
    stripes: dict[int, tuple[str, ...]] = {}
    depth: dict[int, dict[str, int]] = {}  # per stripe: hops from a source
    for k, start, end in runs(keys):
        if k not in stripes:
            stripes[k], depth[k] = flows[start].blocks, dict.fromkeys(sources, 0)
        d = depth[k]
        for src, dst in zip(srcs[start:end], dsts[start:end], strict=True):
            d[dst] = d[src] + 1
    f_count = len(stripes)
    by_name = topo.by_name
    node = {i.id: by_name[i.node] for i in (*plan.sources, *plan.targets)}
    leaf = {i: n.leaf for i, n in node.items()}.__getitem__
    outs = Counter(srcs)
    crosses = list(map(ne, map(leaf, srcs), map(leaf, dsts)))
    cross, cross_in = Counter(compress(srcs, crosses)), Counter(compress(dsts, crosses))
    cap = max(1, int(topo.inter_leaf_ratio * f_count + 1e-9))
    if (max(outs.values()) > f_count or max(cross.values(), default=0) > cap
            or max(cross_in.values(), default=0) > cap):
        return None
    bw = min(n.nic_gbps for n in node.values())
    rate = min(bw / f_count, bw * topo.inter_leaf_ratio if cross else bw) * 1e9 / 8
    sizes = dict(zip(plan.model.block_ids, plan.model.block_bytes, strict=True))
    stripe_bytes = max(sum(math.ceil(sizes[b] / g) for b in blocks) for blocks in stripes.values())
    chunk = min(cost.chunk_bytes, math.ceil(max(plan.model.block_bytes) / g))
    hops = max(max(d.values()) for d in depth.values())
    gather = max(plan.model.block_bytes) * (g - 1) / g / (topo.nvlink_gbps * 1e9 / 8)
    return (stripe_bytes + (hops - 1) * chunk) / rate + chunk / rate + hops * cost.hop_latency_s + gather


def choose(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
           kv_flows: Sequence[tuple[str, str]] = (), overloaded: Sequence[str] = (), shard: bool = True,
           cost: CostParams = CostParams()) -> Plan:
    if not targets:
        raise PlanError("no targets to load")
    exact = len(targets) <= EXACT_MAX
    scored: list[tuple[float, int, str, Plan | None]] = []
    # tp>1 targets: hybrid and binomial plans run over g shard planes (one per GPU link) when every
    # target has the same g and every source can drive g links; otherwise only chains shard.
    planes = plane_width(sources, targets, topo)[0] if shard else 1
    hybrid_ok = {t.gpus for t in targets} <= {1} or planes > 1
    hybrids: list[tuple[float, int, str, Plan | None]] = []
    if hybrid_ok:
        for f in stripe_options(topo, exact):
            p = shard_plan(build_hybrid(topo, model, sources, targets, f, kv_flows), topo)
            t = None if exact else estimate_hybrid(p, topo, cost)
            hybrids.append((predict(p, topo, cost).makespan if t is None else t, 1, f"hybrid (f={f})", p))
    scored.extend(hybrids)
    floor = chain_floor(topo, model, sources, targets, cost)
    if exact or floor < min((h[0] for h in hybrids), default=math.inf):
        chain = build_chains(topo, model, sources, targets, kv_flows, overloaded, ChainOptions(shard=shard))
        scored.append((predict(chain, topo, cost).makespan if exact else estimate_chain(chain, topo, cost), 0,
                       "chain", chain))
    else:  # no chain plan can beat the best hybrid: its pipeline fill alone is longer (not built)
        scored.append((floor, 0, "chain (at least; not built)", None))
    if len(targets) <= BINOMIAL_MAX and hybrid_ok:
        b = shard_plan(build_binomial(model, sources, targets, topo=topo, cost=cost, kv_flows=kv_flows), topo)
        scored.append((predict(b, topo, cost).makespan, 2, "binomial", b))
    best = min((x for x in scored if x[3] is not None), key=lambda x: (x[0] * (1 + 1e-6 * x[1]), x[1]))
    plan = best[3]
    assert plan is not None
    how = "predicted" if exact else "estimated (closed form)"
    others = "; ".join(f"{name} {t:.3f} s" for t, _, name, _ in sorted(scored, key=lambda x: x[0]) if name != best[2])
    why = f"auto: {best[2]} {how} {best[0]:.3f} s, the fastest" + (f" (others: {others})" if others else "")
    return Plan(plan.algorithm, plan.model, plan.sources, plan.targets, plan.flows, plan.chains, plan.fallbacks,
                plan.live_pairs, plan.pipelines, plan.predicted, (*plan.notes, why), plan.steps)
