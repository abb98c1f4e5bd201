"""Hybrid multicast: striped trees inside leaves, joined across the spine by striped leaf trees.

Why: a chain's pipeline fill grows with its length (n-1 chunk times), so thousands of targets fed by
a few sources fall far from the bound; a binomial pipeline is logarithmic but needs step-by-step
execution. Striped trees are logarithmic and stream: the model is cut into f stripes (block i goes
to stripe i mod f) and every target receives each stripe once and forwards at most f flows, each at
1/f of its link, so every link carries a constant, even share for the whole transfer: the cost model
(`cost._predict_shared`) and TCP's fair sharing agree. Completion ~ |M|/B + depth·f·chunk/B.

Two levels, because the spine is where bandwidth is short (spine-aware striping):
- inside a leaf, stripe j enters at one member (member j: the f stripes enter through f different
  nodes, each pulling one stripe over the spine) and spreads down an f-ary tree of that leaf's
  members (relays for stripe j: members j, j+f, ...; in-order layout, so relays near every member);
- across leaves, a leaf has exactly f spare sending slots (f·n slots, f·(n-1) used inside), all
  given to one stripe sigma(L) = its rank mod f: per stripe, leaves form an f-ary tree (interior
  leaves: those with sigma = j), the f cross-leaf flows leaving a leaf start at f different members,
  so no GPU link carries more cross-leaf flows than its share of the uplink (with a 1:r spine, f >= r
  keeps one cross-leaf stripe within a link's spine share). The source's own leaf gives one slot to
  each stripe (it is the root of all f leaf trees).
Data flow: targets by (leaf, domain, id) -> leaves dealt to sources (each source its own leaf first,
then the rest to the least loaded) -> per source: leaf trees per stripe, entries, member trees ->
flows listed senders first (leaf tree breadth first, each leaf's member trees after its entry).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from functools import lru_cache
from operator import attrgetter
from typing import NamedTuple

from kascade_planner.chains import prune_sources
from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError, new_flow, new_flows
from kascade_planner.topology import Topology


def stripes_of(block_ids: Sequence[str], f: int) -> list[tuple[str, ...]]:
    """Stripe j holds blocks j, j+f, j+2f, ...: every stripe spans the model, so layers arrive in order."""
    return [tuple(block_ids[j::f]) for j in range(f)]


def _relay_tree(relays: Sequence[int], f: int) -> list[tuple[int, int]]:
    """A balanced f-ary tree over `relays` (positions, in order) laid out in order: each run's middle
    relay is the parent of its f sub-runs' middles. In-order layout spreads the tree's lower levels
    evenly over the group, so every stretch of the group has relays with spare slots nearby.
    Returns (parent, child) position pairs, parents first; the root's parent is -1."""
    edges: list[tuple[int, int]] = []
    todo: deque[tuple[int, list[int]]] = deque([(-1, list(relays))])
    while todo:
        parent, run = todo.popleft()
        mid = len(run) // 2 if parent >= 0 else 0  # the root first: it is fed soonest
        edges.append((parent, run[mid]))
        rest = run[:mid] + run[mid + 1:]
        cuts = [round(i * len(rest) / f) for i in range(f + 1)]
        todo.extend((run[mid], rest[cuts[i]:cuts[i + 1]]) for i in range(f) if cuts[i] < cuts[i + 1])
    return edges


@lru_cache(maxsize=256)
def _tree(n: int, j: int, f: int) -> tuple[tuple[int, int], ...]:
    """(parent, child) position pairs of stripe j's tree over a group of n targets (-1: the source),
    senders first. Relays: positions j, j+f, ...; every other member hangs off a nearby relay with a
    free slot (each relay has f; when n mod f is not 0 or 1, a few relays have f+1)."""
    relays = list(range(j, n, f)) or [0]
    edges = _relay_tree(relays, f)
    free: dict[int, int] = {r: f for r in relays}
    for parent, _ in edges:
        if parent >= 0:
            free[parent] -= 1
    slots = [r for r in relays for _ in range(max(0, free[r]))]
    others = [p for p in range(n) if p not in free]
    if len(others) > len(slots):
        # n mod f not in {0, 1}: the relays' f slots each fall short by a few; the last relays take
        # one more child each (their flows then share a link f+1 ways, which the cost model charges).
        short = len(others) - len(slots)
        extra = relays[-short:] if short <= len(relays) else [relays[i % len(relays)] for i in range(short)]
        slots = sorted([*slots, *extra])
    step = len(slots) / len(others) if others else 0.0
    taken = [slots[min(len(slots) - 1, int(m * step + step / 2))] for m in range(len(others))]
    edges.extend(zip(taken, others, strict=True))
    return tuple(edges)


def build_hybrid(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
                 stripes: int = 2, kv_flows: Sequence[tuple[str, str]] = ()) -> Plan:
    if not targets:
        raise PlanError("no targets to load")
    if stripes < 1:
        raise PlanError(f"hybrid needs stripes >= 1, got {stripes}")
    usable, notes = prune_sources(sorted(sources, key=lambda s: s.id), kv_flows)
    if not usable:
        raise PlanError("hybrid needs at least one source")
    by_name = topo.by_name
    for i in (*usable, *targets):
        if i.node not in by_name:
            topo.node(i.node)  # raises, naming the node

    def place(i: Instance) -> tuple[str, str, str]:
        n = by_name[i.node]
        return (n.leaf, n.domain, i.id)

    f = max(1, min(stripes, len(model.block_ids)))
    parts = stripes_of(model.block_ids, f)
    # Targets per leaf (leaves in name order), each leaf's by (domain, id).
    by_leaf: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)
    for t in targets:
        n = by_name[t.node]
        by_leaf[n.leaf].append((n.domain, t.id))
    members = {leaf: [tid for _, tid in sorted(by_leaf[leaf])] for leaf in sorted(by_leaf)}
    heads = sorted(usable, key=place)
    # Leaves to sources: each source its own leaf first, then every other leaf to the least loaded.
    groups: list[list[str]] = [[] for _ in heads]
    load = [0] * len(heads)
    for g, h in enumerate(heads):
        leaf = by_name[h.node].leaf
        if leaf in members and not any(leaf in x for x in groups):
            groups[g].append(leaf)
            load[g] += len(members[leaf])
    taken = {leaf for x in groups for leaf in x}
    for leaf in sorted(members, key=lambda lf: (-len(members[lf]), lf)):
        if leaf not in taken:
            g = min(range(len(heads)), key=lambda i: (load[i], i))
            groups[g].append(leaf)
            load[g] += len(members[leaf])
    cross_cap = max(1, int(topo.inter_leaf_ratio * f + 1e-9))  # cross-leaf stripe flows one link carries
    # Leaves of equal size share their member trees: one shape per size, built once per plan.
    shapes = {n: _member_shape(n, f) for n in {len(ids) for ids in members.values()}}
    flows: list[Flow] = []
    for g, h in enumerate(heads):
        if groups[g]:
            flows.extend(_group_flows(h.id, groups[g], members, shapes, parts, f, cross_cap))
    by_id = attrgetter("id")
    src_ids = tuple(s.id for s in sorted(usable, key=by_id))[:2]
    tgts = tuple(sorted(targets, key=by_id))
    fallbacks = tuple([(t.id, src_ids) for t in tgts])
    used = sum(1 for x in groups if x)
    notes.append(f"{f} stripes, {used} source(s) feeding {len(members)} leaves")
    return Plan("hybrid", model, tuple(sorted(sources, key=lambda s: s.id)), tgts, tuple(flows), (), fallbacks,
                notes=tuple(notes))


def _leaf_tree(leaves: Sequence[str], j: int, f: int) -> list[tuple[int, int]]:
    """Stripe j's tree over a source's leaves (index 0: the root leaf, fed by the source), as
    (parent, child) leaf indices, parents first. The root gives stripe j one child; other leaves are
    interior for stripe j when their rank is j mod f (f children each), heap order."""
    rest = list(range(1, len(leaves)))
    if not rest:
        return []
    interior = [x for x in rest if (x - 1) % f == j]
    order = interior + [x for x in rest if (x - 1) % f != j]
    edges = [(0, order[0])]
    n_int = max(1, len(interior))
    for p in range(1, len(order)):
        parent = min((p - 1) // f, n_int - 1)  # past the interior leaves' slots: the last takes extras
        edges.append((order[parent], order[p]))
    return edges


class _Shape(NamedTuple):
    """A leaf of n members' f member trees, with what the flow builder reads from them per stripe j."""

    used: tuple[int, ...]  # per position: sending slots its member trees use (all stripes)
    prefer: tuple[tuple[int, ...], ...]  # [j]: positions, shallowest in stripe j's tree first (then position)
    # [j]: stripe j's tree edges inside the leaf (not the root's, fed from outside), senders first:
    # parents[j][e] sends to kids[j][e].
    parents: tuple[tuple[int, ...], ...]
    kids: tuple[tuple[int, ...], ...]


def _member_shape(n: int, f: int) -> _Shape:
    """The f member trees (`_tree`) of a leaf of n targets, read once for every leaf of that size."""
    trees = [_tree(n, j if n >= f else j % n, f) for j in range(f)]
    used = [0] * n
    prefer: list[tuple[int, ...]] = []
    for edges in trees:
        depth = {-1: 0}
        for a, b in edges:
            depth[b] = depth[a] + 1
            if a >= 0:
                used[a] += 1
        prefer.append(tuple(q for _, q in sorted((depth.get(q, n), q) for q in range(n))))
    inner = [[(a, b) for a, b in edges if a >= 0] for edges in trees]
    return _Shape(tuple(used), tuple(prefer), tuple(tuple(a for a, _ in e) for e in inner),
                  tuple(tuple(b for _, b in e) for e in inner))


def _pick_sender(prefer: Sequence[int], count: Sequence[int], ids: Sequence[str], cross_used: dict[str, int],
                 f: int, cross_cap: int) -> int:
    """The position minimising (slots full, cross-leaf budget spent, depth, position), `prefer` being
    the positions by (depth, position): the first with a free slot and budget left, else the first
    with a free slot, else the first with budget left, else the first."""
    with_slot = [q for q in prefer if count[q] < f]  # usually few: member trees use most slots
    for pool in (with_slot, prefer):
        for q in pool:
            if cross_used.get(ids[q], 0) < cross_cap:
                return q
        if pool:
            return pool[0]
    return prefer[0]


def _group_flows(head: str, leaves: Sequence[str], members: dict[str, list[str]], shapes: dict[int, _Shape],
                 parts: Sequence[tuple[str, ...]], f: int, cross_cap: int) -> list[Flow]:
    """One source's flows: per stripe, down the leaf tree breadth first; per leaf, the cross-leaf
    flow into its entry for the stripe, then the stripe's member tree inside the leaf."""
    # Per leaf: each member's used slots (its member trees' from the shape, then cross-leaf sends).
    used = {leaf: list(shapes[len(members[leaf])].used) for leaf in leaves}
    leaf_edges = [_leaf_tree(leaves, j, f) for j in range(f)]
    children: dict[tuple[int, int], list[int]] = {}
    for j, pairs in enumerate(leaf_edges):
        for a, b in pairs:
            children.setdefault((j, a), []).append(b)
    # Cross-leaf senders: members with spare slots, shallowest in the stripe's tree first, each
    # sending at most `cross_cap` cross-leaf flows (then the fullest spare slots, if any are left).
    sender: dict[tuple[int, int], str] = {}  # (stripe, child leaf index) -> member id in the parent
    cross_used: dict[str, int] = {}
    for (j, a), kids in sorted(children.items()):
        leaf = leaves[a]
        ids = members[leaf]
        prefer = shapes[len(ids)].prefer[j]
        count = used[leaf]
        for child in kids:
            p = _pick_sender(prefer, count, ids, cross_used, f, cross_cap)
            count[p] += 1
            cross_used[ids[p]] = cross_used.get(ids[p], 0) + 1
            sender[(j, child)] = ids[p]
    flows: list[Flow] = []
    for j in range(f):
        order = [0, *(b for _, b in leaf_edges[j])]
        for li in order:
            leaf = leaves[li]
            ids = members[leaf]
            shape = shapes[len(ids)]
            entry = ids[j % len(ids)]
            src = head if li == 0 else sender[(j, li)]
            flows.append(new_flow(src, entry, parts[j]))
            member = ids.__getitem__
            flows.extend(new_flows(map(member, shape.parents[j]), map(member, shape.kids[j]), parts[j]))
    return flows
