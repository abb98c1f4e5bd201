"""λScale k-way binomial-pipeline multicast with execution pipelines.

Data flow: k sources, N receivers -> k sub-groups (round robin) -> the model's blocks split into k
chunks; sub-group j receives the chunks circularly shifted by j (Alg. 1), so early on every sub-group
holds a different part of the model -> within a sub-group a binomial pipeline over a hypercube: at
step s every node exchanges with its partner across dimension s mod d, sending the first block (in the
sub-group's order) that it holds and the partner lacks; 1 -> N then takes b + ceil(log2 N) - 1 steps
-> execution pipelines (Alg. 2): one node from each sub-group, which together hold the whole model
soonest and can serve cooperatively while loading.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError


def shifted_orders(block_ids: Sequence[str], k: int) -> list[tuple[str, ...]]:
    """Alg. 1: k contiguous chunks; sub-group j gets chunks j, j+1, ..., j-1 (mod k)."""
    n = len(block_ids)
    bounds = [round(i * n / k) for i in range(k + 1)]
    chunks = [tuple(block_ids[bounds[i]:bounds[i + 1]]) for i in range(k)]
    return [tuple(b for c in chunks[j:] + chunks[:j] for b in c) for j in range(k)]


def binomial_schedule(order: Sequence[str], n_receivers: int) -> tuple[list[tuple[int, int, str]], int]:
    """Pipelined broadcast from node 0 to nodes 1..n, one block per link direction per step.

    Hypercube pairs first (partner across dimension step mod d), then idle links are filled greedily
    (neediest receiver, richest idle sender), which handles N + 1 that is not a power of two. The source
    injects a block nobody holds yet whenever one is left. Returns the (src, dst, block) sends in step
    order and the number of steps (b + ceil(log2 N) - 1 on full hypercubes, a few more otherwise).
    """
    if n_receivers <= 0:
        return [], 0
    d = max(1, math.ceil(math.log2(n_receivers + 1)))
    nodes = n_receivers + 1
    total = len(order)
    rank = {b: i for i, b in enumerate(order)}
    held: list[set[str]] = [set(order)] + [set() for _ in range(n_receivers)]
    sends: list[tuple[int, int, str]] = []
    step = 0
    while any(len(h) < total for h in held):
        snap = [frozenset(h) for h in held]
        sent: set[int] = set()
        recv: set[int] = set()

        def give(x: int, y: int, snap: list[frozenset[str]] = snap, sent: set[int] = sent,
                 recv: set[int] = recv) -> bool:
            missing = [b for b in order if b in snap[x] and b not in snap[y]]
            if x == 0:
                fresh = [b for b in missing if not any(b in h for h in snap[1:])]
                missing = fresh or missing
            if not missing:
                return False
            b = min(missing, key=rank.__getitem__)
            held[y].add(b)
            sent.add(x)
            recv.add(y)
            sends.append((x, y, b))
            return True

        dim = step % d
        for x in range(nodes):
            y = x ^ (1 << dim)
            if 0 < y < nodes and x not in sent and y not in recv:
                give(x, y)
        for y in sorted(range(1, nodes), key=lambda z: (len(snap[z]), z)):
            if y in recv or len(snap[y]) == total:
                continue
            for x in sorted(range(nodes), key=lambda z: (-len(snap[z]), z)):
                if x != y and x not in sent and give(x, y):
                    break
        step += 1
        if step > 4 * (total + d) + 16:
            raise PlanError("binomial schedule did not converge")
    return sends, step


def build_binomial(model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
                   k: int | None = None) -> Plan:
    if not sources or not targets:
        raise PlanError("binomial needs at least one source and one target")
    srcs = sorted(sources, key=lambda s: s.id)
    k = min(k or len(srcs), len(srcs), len(targets))
    tgts = sorted(targets, key=lambda t: t.id)
    groups = [tgts[j::k] for j in range(k)]
    orders = shifted_orders(model.block_ids, k)
    flows: list[Flow] = []
    steps_max = 0
    for j, group in enumerate(groups):
        members = [srcs[j], *group]
        sends, steps = binomial_schedule(orders[j], len(group))
        steps_max = max(steps_max, steps)
        per_edge: dict[tuple[int, int], list[str]] = {}
        for x, y, b in sends:
            per_edge.setdefault((x, y), []).append(b)
        for (x, y), blocks in sorted(per_edge.items()):
            flows.append(Flow(members[x].id, members[y].id, tuple(blocks)))
    pipelines = tuple(tuple(g[r].id for g in groups if r < len(g)) for r in range(max(len(g) for g in groups)))
    fallbacks = tuple((t.id, tuple(s.id for s in srcs[:2])) for t in tgts)
    notes = (f"k={k} sub-groups, {steps_max} steps for {len(model.block_ids)} blocks",)
    return Plan("binomial", model, tuple(srcs), tuple(tgts), tuple(flows), (), fallbacks,
                pipelines=pipelines, notes=notes)
