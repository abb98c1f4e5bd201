"""λScale k-way binomial-pipeline multicast with execution pipelines.

Data flow: k sources, N receivers -> k sub-groups (round robin) -> the model's blocks split into k
contiguous chunks of near-equal bytes; sub-group j receives the chunks circularly shifted by j (Alg. 1), so early on
every sub-group
holds a different part of the model -> within a sub-group a binomial pipeline over a hypercube: at
step s every node exchanges with its partner across dimension s mod d, sending the first block (in the
sub-group's order) that it holds and the partner lacks; 1 -> N then takes b + ceil(log2 N) - 1 steps
-> execution pipelines (Alg. 2): one node from each sub-group, which together hold the whole model
soonest and can serve cooperatively while loading.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from kascade_planner.chains import prune_sources
from kascade_planner.cost import CostParams, predict
from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError
from kascade_planner.topology import Topology

GROUP_MAX = 64


def chunk_bounds(block_bytes: Sequence[int], k: int) -> list[int]:
    """Where Alg. 1's k contiguous chunks start (k + 1 indices, 0 first, len last), equal in BYTES.

    A pipeline can form once every sub-group holds its own chunk, so the largest chunk sets when that is:
    cut at the block boundary nearest to each i/k of the model's bytes (position i/k of the bytes lies
    inside some block; round that fractional block index). Equal blocks give round(i * n / k), the cut by
    block count. Why bytes: with an embedding and a head half a layer's size (8 layers: chunks of 2, 3, 3
    and 2 blocks by count), the count cut gives the middle chunks 3 layers each, and the pipeline formed
    after 1.77 of 5.25 MB per link instead of 1.44 (ADR 0008)."""
    n = len(block_bytes)
    if k <= 0 or n == 0:
        raise PlanError(f"chunk_bounds needs k >= 1 and blocks, got k={k} and {n} blocks")
    if any(b <= 0 for b in block_bytes):
        raise PlanError("chunk_bounds: block sizes must be > 0")
    total = sum(block_bytes)
    bounds = [0]
    at, before = 0, 0  # block index, bytes of blocks [0, at)
    for i in range(1, k):
        goal = total * i / k
        while at < n and before + block_bytes[at] <= goal:
            before += block_bytes[at]
            at += 1
        frac = at + ((goal - before) / block_bytes[at] if at < n else 0.0)
        bounds.append(min(n, max(bounds[-1], round(frac))))
    return [*bounds, n]


def shifted_orders(block_ids: Sequence[str], k: int, block_bytes: Sequence[int] | None = None) -> list[tuple[str, ...]]:
    """Alg. 1: k contiguous chunks (equal in bytes: `chunk_bounds`; equal in count without sizes);
    sub-group j gets chunks j, j+1, ..., j-1 (mod k)."""
    sizes = block_bytes if block_bytes is not None else [1] * len(block_ids)
    if len(sizes) != len(block_ids):
        raise PlanError(f"shifted_orders: {len(sizes)} block sizes for {len(block_ids)} blocks")
    bounds = chunk_bounds(sizes, k)
    chunks = [tuple(block_ids[bounds[i]:bounds[i + 1]]) for i in range(k)]
    return [tuple(b for c in chunks[j:] + chunks[:j] for b in c) for j in range(k)]


def binomial_schedule(order: Sequence[str], n_receivers: int) -> tuple[list[tuple[int, int, int, str]], int]:
    """Pipelined broadcast from node 0 to nodes 1..n, one block per link direction per step.

    Hypercube pairs first (partner across dimension step mod d), then idle links are filled greedily
    (neediest receiver, richest idle sender), which handles N + 1 that is not a power of two. The source
    injects a block nobody holds yet whenever one is left. Returns the (step, src, dst, block) sends in
    step order and the number of steps (b + ceil(log2 N) - 1 on full hypercubes, a few more otherwise).
    """
    if n_receivers <= 0:
        return [], 0
    d = max(1, math.ceil(math.log2(n_receivers + 1)))
    nodes = n_receivers + 1
    total = len(order)
    # Held blocks as bit masks over positions in `order` (bit i = order[i]): "the first missing block
    # in order" is the lowest set bit, and a step's snapshot is a list of ints, not of sets.
    full = (1 << total) - 1
    held = [full] + [0] * n_receivers
    sends: list[tuple[int, int, int, str]] = []
    step = 0
    while any(h != full for h in held):
        snap = held[:]
        anywhere = 0  # blocks some receiver already holds (the source prefers to inject fresh ones)
        for h in snap[1:]:
            anywhere |= h
        sent: set[int] = set()
        recv: set[int] = set()

        def give(x: int, y: int, snap: list[int] = snap, sent: set[int] = sent, recv: set[int] = recv,
                 step: int = step, anywhere: int = anywhere) -> bool:
            missing = snap[x] & ~snap[y]
            if x == 0:
                missing = (missing & ~anywhere) or missing
            if not missing:
                return False
            i = (missing & -missing).bit_length() - 1
            held[y] |= 1 << i
            sent.add(x)
            recv.add(y)
            sends.append((step, x, y, order[i]))
            return True

        dim = step % d
        for x in range(nodes):
            y = x ^ (1 << dim)
            if 0 < y < nodes and x not in sent and y not in recv:
                give(x, y)
        counts = [h.bit_count() for h in snap]
        richest = sorted(range(nodes), key=lambda z: (-counts[z], z))
        for y in sorted(range(1, nodes), key=lambda z: (counts[z], z)):
            if y in recv or counts[y] == total:
                continue
            for x in richest:
                if x != y and x not in sent and give(x, y):
                    break
        step += 1
        if step > 4 * (total + d) + 16:
            raise PlanError("binomial schedule did not converge")
    return sends, step


def _groups(srcs: Sequence[Instance], tgts: Sequence[Instance], k: int,
            leaf_of: Callable[[Instance], str]) -> list[list[Instance]]:
    """k sub-groups of near-equal size, each a contiguous run of the targets in (leaf, id) order, so
    a sub-group's hypercube pairs (low dimensions: neighbours) mostly stay inside a leaf; sources in
    the same (leaf, id) order head them."""
    ordered = sorted(tgts, key=lambda t: (leaf_of(t), t.id))
    bounds = [round(i * len(ordered) / k) for i in range(k + 1)]
    return [ordered[bounds[j]:bounds[j + 1]] for j in range(k)]


def _binomial_plan(model: ModelLayout, srcs: Sequence[Instance], tgts: Sequence[Instance], k: int,
                   leaf_of: Callable[[Instance], str]) -> Plan:
    heads = sorted(srcs, key=lambda s: (leaf_of(s), s.id))[:k]
    groups = _groups(srcs, tgts, k, leaf_of)
    orders = shifted_orders(model.block_ids, k, model.block_bytes)
    flows: list[Flow] = []
    steps: list[tuple[int, ...]] = []
    steps_max = 0
    for j, group in enumerate(groups):
        members = [heads[j], *group]
        sends, n_steps = binomial_schedule(orders[j], len(group))
        steps_max = max(steps_max, n_steps)
        per_edge: dict[tuple[int, int], tuple[list[str], list[int]]] = {}
        for st, x, y, b in sends:
            blocks, at = per_edge.setdefault((x, y), ([], []))
            blocks.append(b)
            at.append(st)
        for (x, y), (blocks, at) in sorted(per_edge.items(), key=lambda e: (e[1][1][0], e[0])):
            flows.append(Flow(members[x].id, members[y].id, tuple(blocks)))
            steps.append(tuple(at))
    pipelines = tuple(tuple(g[r].id for g in groups if r < len(g)) for r in range(max(len(g) for g in groups)))
    by_id = sorted(tgts, key=lambda t: t.id)
    fallbacks = tuple((t.id, tuple(s.id for s in sorted(srcs, key=lambda s: s.id)[:2])) for t in by_id)
    notes = (f"k={k} sub-groups, {steps_max} steps for {len(model.block_ids)} blocks",)
    return Plan("binomial", model, tuple(sorted(srcs, key=lambda s: s.id)), tuple(by_id), tuple(flows), (),
                fallbacks, pipelines=pipelines, notes=notes, steps=tuple(steps))


def build_binomial(model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
                   k: int | None = None, topo: Topology | None = None, cost: CostParams = CostParams(),
                   kv_flows: Sequence[tuple[str, str]] = ()) -> Plan:
    """λScale's k-way binomial pipeline. `k` None: with a topology, the cost model picks k among
    1, 2, 4, ... and the number of sources (fewer, larger sub-groups pipeline more blocks per step;
    more sub-groups use more sources); without one, k = the number of sources. Sources whose egress
    carries a KV flow are pruned, as for chains (a link carries at most one flow per direction)."""
    if not sources or not targets:
        raise PlanError("binomial needs at least one source and one target")
    srcs, pruned = prune_sources(sorted(sources, key=lambda s: s.id), kv_flows)
    if pruned:
        plan = build_binomial(model, srcs, targets, k, topo, cost)
        return replace(plan, sources=tuple(sorted(sources, key=lambda s: s.id)), notes=(*pruned, *plan.notes))
    limit = min(len(srcs), len(targets))
    leaf: Callable[[Instance], str] = (lambda i: topo.node(i.node).leaf) if topo is not None else (lambda i: "")
    if k is not None or topo is None:
        return _binomial_plan(model, srcs, targets, min(k or limit, limit), leaf)
    # Sub-groups of more than GROUP_MAX targets are not tried (the schedule is built step by step,
    # quadratic in a sub-group's size); the largest k is always a candidate.
    options = sorted({*(2 ** e for e in range(limit.bit_length())
                        if 2 ** e <= limit and math.ceil(len(targets) / 2 ** e) <= GROUP_MAX), limit})
    best: tuple[float, int, Plan] | None = None
    for kk in options:
        plan = _binomial_plan(model, srcs, targets, kk, leaf)
        t = predict(plan, topo, cost).makespan
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, kk, plan)
    assert best is not None
    t, kk, plan = best
    return replace(plan, notes=(*plan.notes, f"k={kk} chosen by the cost model among {options}: {t:.3f} s"))
