"""Cost model: when does every block arrive at every target under a plan?

Data flow: (Plan, Topology, CostParams) -> list scheduling of (flow, block) transmissions -> per-target
per-block arrival times -> `Prediction`. Each GPU of an instance has one egress and one ingress queue
(a link carries one transmission per direction at a time, so a sender feeding several receivers
shares its NIC). Forwarding is cut-through per chunk: a hop may start once its sender holds the first
chunk of a block and cannot finish before the sender holds the whole block plus one chunk time.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from kascade_planner.plan import Flow, Instance, Plan, PlanError
from kascade_planner.topology import Topology


@dataclass(frozen=True)
class CostParams:
    chunk_bytes: int = 16 << 20
    hop_latency_s: float = 20e-6


@dataclass(frozen=True)
class Prediction:
    arrival: tuple[tuple[str, tuple[tuple[str, float], ...]], ...]  # target -> ((block, seconds), ...)
    completion: tuple[tuple[str, float], ...]  # target -> seconds

    @property
    def makespan(self) -> float:
        return max((t for _, t in self.completion), default=0.0)


def pair_gbps(topo: Topology, src: Instance, dst: Instance) -> float:
    """Per-GPU bandwidth of one hop; host and SSD copies load over PCIe / the disk on their node."""
    if src.kind == "ssd":
        if src.node != dst.node:
            raise PlanError(f"{src.id!r}: an SSD copy can only load its own node {src.node!r}")
        return topo.ssd_gbps
    if src.kind == "host" and src.node == dst.node:
        return topo.pcie_gbps
    bw = topo.bandwidth_gbps(src.node, dst.node)
    return min(bw, topo.pcie_gbps) if src.kind == "host" else bw


def is_local_read(src: Instance, dst: Instance) -> bool:
    """A host-memory or SSD copy read by a GPU on its own node: over that GPU's own PCIe / SSD link."""
    return src.kind != "gpu" and src.node == dst.node


def egress_key(f: Flow, src: Instance, dst: Instance) -> tuple[str, int]:
    """The sending link's queue: (sender, GPU slot); for a local read the receiving GPU's own link
    (each GPU reads host memory or its SSD in parallel with the others on the node)."""
    slot = f.shard[0] if f.shard else 0
    return (f"{f.src}>{f.dst}", slot) if is_local_read(src, dst) else (f.src, slot)


def predict(plan: Plan, topo: Topology, params: CostParams = CostParams()) -> Prediction:
    if plan.steps:
        return _predict_steps(plan, topo, params)
    if plan.algorithm == "hybrid":
        shared = _predict_shared(plan, topo, params)
        if shared is not None:
            return shared
    fast = _predict_pipelined(plan, topo, params)
    return fast if fast is not None else _predict_events(plan, topo, params)


def _finish(plan: Plan, have: dict[tuple[str, str], tuple[float, float]]) -> Prediction:
    arrival = []
    completion = []
    for tgt in plan.targets:
        per = tuple((b, have[(tgt.id, b)][1]) for b in plan.model.block_ids if (tgt.id, b) in have)
        if len(per) != len(plan.model.block_ids):
            raise PlanError(f"target {tgt.id!r} does not receive every block")
        arrival.append((tgt.id, per))
        completion.append((tgt.id, max(t for _, t in per)))
    return Prediction(tuple(arrival), tuple(completion))


def _predict_steps(plan: Plan, topo: Topology, params: CostParams) -> Prediction:
    """Step-scheduled plans (binomial): every link sends its blocks in step order (a list schedule:
    one block per link direction at a time, cut-through per chunk as everywhere). The sends are
    taken in step order, so a relay's block is always known before it is forwarded. Shard planes
    (`sharding.shard_plan`): each (instance, GPU) link is its own queue, a relay forwards the shard
    it holds, and a target holds a block once all its shards arrived plus the NVLink all-gather."""
    sizes = dict(zip(plan.model.block_ids, plan.model.block_bytes, strict=True))
    inst = {i.id: i for i in (*plan.sources, *plan.targets)}
    source_ids = {s.id for s in plan.sources}
    flows = plan.flows
    rates = [pair_gbps(topo, inst[f.src], inst[f.dst]) * 1e9 / 8 for f in flows]
    out_keys = [egress_key(f, inst[f.src], inst[f.dst]) for f in flows]
    sends = sorted((st, k, i) for k, steps in enumerate(plan.steps) for i, st in enumerate(steps))
    have: dict[tuple[str, str], tuple[float, float]] = {}  # (instance, block) -> (first chunk, full)
    parts: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}  # shards held so far
    egress: dict[tuple[str, int], float] = {}
    ingress: dict[tuple[str, int], float] = {}
    lat = params.hop_latency_s
    nvlink = topo.nvlink_gbps * 1e9 / 8
    for _, k, i in sends:
        f = flows[k]
        b = f.blocks[i]
        slot, count = f.shard if f.shard else (0, 1)
        if f.src in source_ids:
            first, full = 0.0, 0.0
        elif f.shard and slot in parts.get((f.src, b), {}):
            first, full = parts[(f.src, b)][slot]
        elif (f.src, b) in have:
            first, full = have[(f.src, b)]
        else:
            raise PlanError(f"{f.src!r} must forward block {b!r} at step {plan.steps[k][i]} before it holds it")
        nbytes = math.ceil(sizes[b] / count)
        c = min(params.chunk_bytes, nbytes) / rates[k]
        start = max(first, egress.get(out_keys[k], 0.0), ingress.get((f.dst, slot), 0.0))
        end = max(start + nbytes / rates[k], full + c)
        egress[out_keys[k]] = ingress[(f.dst, slot)] = end
        got = (start + c + lat, end + lat)
        if not f.shard:
            have[(f.dst, b)] = got
            continue
        held = parts.setdefault((f.dst, b), {})
        held[slot] = got
        if len(held) == count:
            gather = sizes[b] * (count - 1) / count / nvlink
            have[(f.dst, b)] = (max(p[0] for p in held.values()), max(p[1] for p in held.values()) + gather)
    return _finish(plan, have)


def link_shares(plan: Plan, topo: Topology | None = None) -> list[tuple[int, int]]:
    """Per flow, (how many flows share its busier end, how many cross-leaf flows share its busier
    end; 0 for a flow inside a leaf). Flows that stream concurrently split a link evenly (TCP does;
    so does the cost model for such plans), and a GPU link's cross-leaf traffic together gets at most
    its share of the leaf's uplink (the inter-leaf ratio of the link), per direction."""
    inst = {i.id: i for i in (*plan.sources, *plan.targets)}
    by_name = topo.by_name if topo is not None else {}
    outs: dict[tuple[str, int], int] = {}
    ins: dict[tuple[str, int], int] = {}
    cross_out: dict[tuple[str, int], int] = {}
    cross_in: dict[tuple[str, int], int] = {}
    keys = []
    for f in plan.flows:
        a, b = inst[f.src], inst[f.dst]
        o, i = egress_key(f, a, b), (f.dst, f.shard[0] if f.shard else 0)
        outs[o] = outs.get(o, 0) + 1
        ins[i] = ins.get(i, 0) + 1
        cross = bool(by_name) and by_name[a.node].leaf != by_name[b.node].leaf
        if cross:
            cross_out[o] = cross_out.get(o, 0) + 1
            cross_in[i] = cross_in.get(i, 0) + 1
        keys.append((o, i, cross))
    return [(max(outs[o], ins[i]), max(cross_out[o], cross_in[i]) if cross else 0) for o, i, cross in keys]


def _predict_shared(plan: Plan, topo: Topology, params: CostParams) -> Prediction | None:
    """Plans whose flows stream concurrently and share links evenly (hybrid striped trees: a node
    forwards its stripe to its children at once, each at 1/n of its link): every flow is a FIFO of
    its blocks at rate min(pair bandwidth, link / sharers), pipelined per chunk (the same recurrence
    as `_predict_pipelined`). Flows are evaluated level by level (a flow's level: one more than the
    flow that brought its blocks to its sender), each level's flows of one block set as one matrix.
    Shard planes (every flow sharded g ways): one row per (instance, GPU), each plane on its own
    links, and a target holds a block once every shard arrived plus the NVLink all-gather.
    None when the plan does not qualify (mixed shard counts, a sender fed by several flows of one
    block set)."""
    counts = {f.shard[1] if f.shard else 1 for f in plan.flows}
    if len(counts) != 1:
        return None
    g = counts.pop()
    index = {b: i for i, b in enumerate(plan.model.block_ids)}
    sizes = np.ceil(np.asarray(plan.model.block_bytes, dtype=np.float64) / g)
    everyone = (*plan.sources, *plan.targets)
    inst = {i.id: i for i in everyone}
    row = {(i.id, s): r for r, (i, s) in enumerate((i, s) for i in everyone for s in range(g))}
    source_ids = {s.id for s in plan.sources}
    ratio = topo.inter_leaf_ratio
    level: dict[tuple[str, int, int], int] = {}
    batches: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    block_sets: dict[int, np.ndarray] = {}
    for f, (share, spine_share) in zip(plan.flows, link_shares(plan, topo), strict=True):
        key = id(f.blocks)
        if key not in block_sets:
            block_sets[key] = np.fromiter((index[b] for b in f.blocks), dtype=np.int64, count=len(f.blocks))
        slot = f.shard[0] if f.shard else 0
        if f.src in source_ids:
            lv = 0
        else:
            got = level.get((f.src, key, slot))
            if got is None:
                return None
            lv = got + 1
        if (f.dst, key, slot) in level:
            return None
        level[(f.dst, key, slot)] = lv
        a, b = inst[f.src], inst[f.dst]
        pair = pair_gbps(topo, a, b)
        link = pair / ratio if spine_share else pair  # the GPU links' own rate
        gbps = min(link / share, pair / spine_share) if spine_share else link / share
        batches.setdefault((lv, key), []).append((row[(f.src, slot)], row[(f.dst, slot)], gbps * 1e9 / 8))
    nb = len(sizes)
    first_at = np.full((len(row), nb), np.inf)
    full_at = np.full((len(row), nb), np.inf)
    for sid in source_ids:
        for s in range(g):
            first_at[row[(sid, s)]] = full_at[row[(sid, s)]] = 0.0
    lat, chunk = params.hop_latency_s, float(params.chunk_bytes)
    for (_, key), items in sorted(batches.items(), key=lambda kv: kv[0][0]):
        idx = block_sets[key]
        src = np.fromiter((x[0] for x in items), dtype=np.int64, count=len(items))
        dst = np.fromiter((x[1] for x in items), dtype=np.int64, count=len(items))
        rate = np.fromiter((x[2] for x in items), dtype=np.float64, count=len(items))[:, None]
        nbytes = sizes[idx][None, :]
        first, full = first_at[src][:, idx], full_at[src][:, idx]
        d = nbytes / rate
        c = np.minimum(chunk, nbytes) / rate
        a = np.maximum(first + d, full + c)
        cum = np.cumsum(d, axis=1)
        finish = cum + np.maximum.accumulate(a - cum, axis=1)
        start = np.maximum(first, np.concatenate((np.zeros((len(items), 1)), finish[:, :-1]), axis=1))
        first_at[dst[:, None], idx[None, :]] = start + c + lat
        full_at[dst[:, None], idx[None, :]] = finish + lat
    rows = np.asarray([[row[(t.id, s)] for s in range(g)] for t in plan.targets], dtype=np.int64)
    held = full_at[rows].max(axis=1)  # (targets, blocks): every shard arrived
    if not np.isfinite(held).all():
        return None
    if g > 1:  # all-gather of the other shards over NVLink
        held = held + np.asarray(plan.model.block_bytes, dtype=np.float64) * (g - 1) / g / (topo.nvlink_gbps * 1e9 / 8)
    whole = plan.model.block_ids
    arrival = tuple((t.id, tuple(zip(whole, held[r].tolist(), strict=True))) for r, t in enumerate(plan.targets))
    completion = tuple((t.id, float(held[r].max())) for r, t in enumerate(plan.targets))
    return Prediction(arrival, completion)


def _predict_pipelined(plan: Plan, topo: Topology, params: CostParams) -> Prediction | None:
    """Closed form for interference-free whole-model plans (chains, with or without shards): when
    every (instance, GPU) sends at most one flow and receives at most one, each link is a FIFO of the
    model's blocks and hop k's finish times obey finish_i = max(a_i, finish_{i-1} + d_i), i.e.
    finish = D + cummax(a - D) with D = cumsum(d): one vectorised pass per flow instead of one event
    per (flow, block). Same arithmetic as `_predict_events` (checked by tests); None when the plan
    does not qualify (shared links, partial flows, flows not listed senders first)."""
    whole = plan.model.block_ids
    outs: set[tuple[str, int]] = set()
    ins: set[tuple[str, int]] = set()
    inst = {i.id: i for i in (*plan.sources, *plan.targets)}
    for f in plan.flows:
        if not (f.blocks is whole or f.blocks == whole):
            return None
        slot = f.shard[0] if f.shard else 0
        out = egress_key(f, inst[f.src], inst[f.dst])
        if out in outs or (f.dst, slot) in ins:
            return None
        outs.add(out)
        ins.add((f.dst, slot))
    sizes = np.asarray(plan.model.block_bytes, dtype=np.float64)
    source_ids = {s.id for s in plan.sources}
    zero = np.zeros(len(whole))
    # instance -> whole-block (first chunk, full) arrival arrays; instance -> shard count, slot -> arrays
    full_at: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    shard_at: dict[str, tuple[int, dict[int, tuple[np.ndarray, np.ndarray]]]] = {}
    lat = params.hop_latency_s
    nvlink = topo.nvlink_gbps * 1e9 / 8
    for f in plan.flows:
        count = f.shard[1] if f.shard else 1
        if f.src in source_ids:
            first, full = zero, zero
        else:
            got = shard_at.get(f.src)
            if f.shard and got and got[0] == count and f.shard[0] in got[1]:
                first, full = got[1][f.shard[0]]
            elif f.src in full_at:
                first, full = full_at[f.src]
            else:
                return None
        rate = pair_gbps(topo, inst[f.src], inst[f.dst]) * 1e9 / 8
        nbytes = np.ceil(sizes / count)
        d = nbytes / rate
        c = np.minimum(float(params.chunk_bytes), nbytes) / rate
        a = np.maximum(first + d, full + c)
        cum = np.cumsum(d)
        finish = cum + np.maximum.accumulate(a - cum)
        start = np.maximum(first, np.concatenate(([0.0], finish[:-1])))
        arrived = (start + c + lat, finish + lat)
        if f.shard is None:
            full_at[f.dst] = arrived
            continue
        got = shard_at.setdefault(f.dst, (count, {}))
        got[1][f.shard[0]] = arrived
        if len(got[1]) == count:  # all shards: all-gathered over NVLink inside the instance
            parts = list(got[1].values())
            full_at[f.dst] = (np.max([p[0] for p in parts], axis=0),
                              np.max([p[1] for p in parts], axis=0) + sizes * (count - 1) / count / nvlink)
    if any(t.id not in full_at for t in plan.targets):
        return None
    arrival = []
    completion = []
    for tgt in plan.targets:
        full = full_at[tgt.id][1].tolist()
        arrival.append((tgt.id, tuple(zip(whole, full, strict=True))))
        completion.append((tgt.id, max(full)))
    return Prediction(tuple(arrival), tuple(completion))


def _predict_events(plan: Plan, topo: Topology, params: CostParams = CostParams()) -> Prediction:
    sizes = dict(zip(plan.model.block_ids, plan.model.block_bytes, strict=True))
    inst = {i.id: i for i in (*plan.sources, *plan.targets)}
    source_ids = {s.id for s in plan.sources}
    # (instance, block) -> per-slot (first-chunk, full) times; slot None = whole block.
    have: dict[tuple[str, str], dict[int | None, tuple[float, float]]] = {}
    shards_needed: dict[tuple[str, str], int] = {}
    for f in plan.flows:
        for b in f.blocks:
            shards_needed[(f.dst, b)] = f.shard[1] if f.shard else 1
    egress: dict[tuple[str, int], float] = {}
    ingress: dict[tuple[str, int], float] = {}
    rates = [pair_gbps(topo, inst[f.src], inst[f.dst]) * 1e9 / 8 for f in plan.flows]
    out_keys = [egress_key(f, inst[f.src], inst[f.dst]) for f in plan.flows]
    pos = [0] * len(plan.flows)
    waiting: dict[tuple[str, str], list[int]] = {}

    def available(f: Flow, b: str) -> tuple[float, float] | None:
        if f.src in source_ids:
            return (0.0, 0.0)
        slots = have.get((f.src, b), {})
        if f.shard and f.shard[0] in slots and shards_needed.get((f.src, b)) == f.shard[1]:
            return slots[f.shard[0]]
        return slots.get(None)

    def start_time(k: int) -> float | None:
        f = plan.flows[k]
        av = available(f, f.blocks[pos[k]])
        if av is None:
            return None
        slot = f.shard[0] if f.shard else 0
        return max(av[0], egress.get(out_keys[k], 0.0), ingress.get((f.dst, slot), 0.0))

    heap: list[tuple[float, int]] = []

    def schedule(k: int) -> None:
        if pos[k] >= len(plan.flows[k].blocks):
            return
        t = start_time(k)
        if t is None:
            waiting.setdefault((plan.flows[k].src, plan.flows[k].blocks[pos[k]]), []).append(k)
        else:
            heapq.heappush(heap, (t, k))

    for k in range(len(plan.flows)):
        schedule(k)
    while heap:
        t, k = heapq.heappop(heap)
        now = start_time(k)
        if now is None or now > t + 1e-12:
            schedule(k)  # stale key: another transmission took the link meanwhile
            continue
        f, b = plan.flows[k], plan.flows[k].blocks[pos[k]]
        count = f.shard[1] if f.shard else 1
        nbytes = math.ceil(sizes[b] / count)
        _, src_full = available(f, b) or (0.0, 0.0)
        chunk_t = min(params.chunk_bytes, nbytes) / rates[k]
        finish = max(now + nbytes / rates[k], src_full + chunk_t)
        slot = f.shard[0] if f.shard else 0
        egress[out_keys[k]] = ingress[(f.dst, slot)] = finish
        got = have.setdefault((f.dst, b), {})
        got[f.shard[0] if f.shard else None] = (now + chunk_t + params.hop_latency_s, finish + params.hop_latency_s)
        if f.shard and len([s for s in got if s is not None]) == count:
            parts = [v for s, v in got.items() if s is not None]
            # Shards are all-gathered over NVLink inside the instance.
            gather = sizes[b] * (count - 1) / count / (topo.nvlink_gbps * 1e9 / 8)
            got[None] = (max(p[0] for p in parts), max(p[1] for p in parts) + gather)
        pos[k] += 1
        schedule(k)
        for w in waiting.pop((f.dst, b), []):
            schedule(w)
    stuck = [k for k in range(len(plan.flows)) if pos[k] < len(plan.flows[k].blocks)]
    if stuck:
        f = plan.flows[stuck[0]]
        raise PlanError(f"{f.src!r} must forward block {f.blocks[pos[stuck[0]]]!r} it never receives")
    arrival = []
    completion = []
    for tgt in plan.targets:
        per = tuple((b, have[(tgt.id, b)][None][1]) for b in plan.model.block_ids if None in have.get((tgt.id, b), {}))
        if len(per) != len(plan.model.block_ids):
            raise PlanError(f"target {tgt.id!r} does not receive every block")
        arrival.append((tgt.id, per))
        completion.append((tgt.id, max(t for _, t in per)))
    return Prediction(tuple(arrival), tuple(completion))


def with_prediction(plan: Plan, topo: Topology, params: CostParams = CostParams()) -> Plan:
    return replace(plan, predicted=predict(plan, topo, params).completion)


def _reachable_gbps(topo: Topology, src: Instance, dst: Instance) -> float:
    try:
        return pair_gbps(topo, src, dst)
    except PlanError:  # e.g. another node's SSD: cannot feed this target at all
        return 0.0


def lower_bound(plan: Plan, topo: Topology, params: CostParams = CostParams()) -> float:
    """No target can finish before the whole model crossed its own GPUs' links at the best bandwidth
    any other holder could offer it (instance-granular transfers), plus one hop latency. Spine-aware:
    a leaf holding no source imports the whole model over the spine, at most at the inter-leaf rate
    on each of its targets' GPU links at once (its per-leaf uplink share), so none of its targets can
    finish before that either."""
    others = [*plan.sources, *plan.targets]
    worst = 0.0
    for t in plan.targets:
        bw = max(_reachable_gbps(topo, o, t) for o in others if o.id != t.id)
        worst = max(worst, plan.model.total_bytes / (t.gpus * bw * 1e9 / 8))
    return max(worst, spine_bound(plan, topo)) + params.hop_latency_s


def spine_bound(plan: Plan, topo: Topology) -> float:
    """The slowest source-less leaf's import of one copy over its uplink: the model's bytes over the
    sum of its targets' GPU links at the inter-leaf rate (0 when every leaf with targets has a source)."""
    by_name = topo.by_name
    held = {by_name[s.node].leaf for s in plan.sources if s.node in by_name}
    uplink: dict[str, float] = {}
    for t in plan.targets:
        node = by_name[t.node]
        if node.leaf not in held:
            uplink[node.leaf] = uplink.get(node.leaf, 0.0) + t.gpus * node.nic_gbps * topo.inter_leaf_ratio
    return max((plan.model.total_bytes / (cap * 1e9 / 8) for cap in uplink.values()), default=0.0)
