"""BlitzScale multi-chain multicast (§5.1): serial forwarding chains S -> T1 -> ... -> Tn.

Data flow: (topology, sources, targets, KV flows) -> prune sources whose egress already carries a
flow (direction-aware interference) -> allot sources to leaves (leaf-local first) -> group each leaf's
targets by scale-up domain and deal the groups to that leaf's chains, longest group first onto the
shortest chain -> order each chain by decreasing bandwidth -> flows (sharded g-wide when both ends
have g GPUs). A chain costs about |M|/B_min + (n-1)·chunk/B_min, nearly independent of n; the tail of
every chain is the next scaling round's source (the parameter pool grows with finished targets).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise, repeat
from operator import attrgetter, itemgetter

from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError, new_flow
from kascade_planner.topology import Topology


@dataclass(frozen=True)
class ChainOptions:
    shard: bool = True  # NVLink-group sharded transfer between equal-TP instances
    max_fallbacks: int = 2


def source_links(src: Instance, topo: Topology) -> int:
    """How many scale-out links an instance can send over at once: a GPU instance one per GPU; a
    host-memory copy every NIC of its node (host memory reaches each GPU's NIC), at least its `gpus`."""
    if src.kind == "host":
        node = topo.by_name.get(src.node)
        return max(src.gpus, node.gpus if node is not None else 1)
    return src.gpus


def hop_flows(src: Instance, dst: Instance, blocks: tuple[str, ...], shard: bool, links: int | None = None) -> list[Flow]:
    """One hop src -> dst: g shard flows over g links when dst has g > 1 GPUs and src can drive g links
    (a GPU instance of the same width, so every relay forwards the shards it receives; or a host copy
    with at least g links), else one whole-model flow. `links`: src's link count (default its GPUs)."""
    g = dst.gpus
    have = src.gpus if links is None else links
    fits = have == g if src.kind == "gpu" else src.kind == "host" and have >= g
    if shard and g > 1 and fits:
        return [new_flow(src.id, dst.id, blocks, (i, g)) for i in range(g)]
    return [new_flow(src.id, dst.id, blocks)]


def prune_sources(sources: Sequence[Instance], kv_flows: Sequence[tuple[str, str]]) -> tuple[list[Instance], list[str]]:
    """Drop sources whose egress already carries a flow (e.g. prefill instances sending KV to decode):
    a link carries at most one flow per direction. Their ingress side stays usable for other work."""
    busy = {src for src, _ in kv_flows}
    kept = [s for s in sources if s.id not in busy]
    notes = [f"pruned source {s.id}: its egress carries a KV flow" for s in sources if s.id in busy]
    if not kept and sources:
        raise PlanError("every source's egress carries a KV flow: no interference-free source "
                        f"(sources: {', '.join(s.id for s in sources)})")
    return kept, notes


def build_chains(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
                 kv_flows: Sequence[tuple[str, str]] = (), overloaded: Sequence[str] = (),
                 options: ChainOptions = ChainOptions()) -> Plan:
    # O(n log n) in the number of targets, and lean per target (it plans 1,024 targets in a few ms):
    # per-target facts are looked up once, flows are built with `new_flow`.
    if not targets:
        raise PlanError("no targets to load")
    srcs_by_id = sorted(sources, key=attrgetter("id"))
    tgts_by_id = sorted(targets, key=attrgetter("id"))
    usable, notes = prune_sources(srcs_by_id, kv_flows)
    by_name = topo.by_name
    for nodes in ({s.node for s in usable}, {t.node for t in targets}):
        if not nodes <= by_name.keys():
            topo.node(min(nodes - by_name.keys()))  # raises, naming the unknown node

    def bw(i: Instance) -> float:
        return by_name[i.node].nic_gbps * i.gpus

    # Targets by leaf, then by scale-up domain (a domain's targets stay adjacent in one chain), each
    # in decreasing bandwidth, then id. On one node bandwidth differs only by GPU count.
    by_node: dict[str, list[Instance]] = {}
    for t in tgts_by_id:
        on_node = by_node.get(t.node)
        if on_node is None:
            by_node[t.node] = [t]
        else:
            on_node.append(t)
    tgt_gpus = {t.gpus for t in tgts_by_id}
    if len(tgt_gpus) > 1:
        for on_node in by_node.values():
            on_node.sort(key=lambda t: -t.gpus)  # stable: ties stay in id order
    by_leaf: dict[str, dict[str, list[Instance]]] = {}
    spans: set[tuple[str, str]] = set()  # domains spanning several nodes: re-sort their members
    for name, on_node in sorted(by_node.items(), key=lambda kv: (-bw(kv[1][0]), kv[1][0].id)):
        node = by_name[name]
        group = by_leaf.setdefault(node.leaf, {}).setdefault(node.domain, [])
        if group:
            spans.add((node.leaf, node.domain))
        group.extend(on_node)
    for leaf, dom in spans:
        by_leaf[leaf][dom].sort(key=lambda t: (-bw(t), t.id))
    src_by_leaf: dict[str, list[Instance]] = defaultdict(list)
    for s in sorted(usable, key=lambda s: (-bw(s), s.id)):
        src_by_leaf[by_name[s.node].leaf].append(s)

    # Allot sources: each leaf with targets keeps its own sources; leaves without any borrow spare
    # sources from leaves with the most sources per target (one cross-leaf hop per chain at most).
    demand = {leaf: sum(len(g) for g in doms.values()) for leaf, doms in by_leaf.items()}
    allot: dict[str, list[Instance]] = {leaf: list(src_by_leaf.get(leaf, [])) for leaf in demand}
    spare = [s for leaf, ss in sorted(src_by_leaf.items()) if leaf not in demand for s in ss]
    for leaf in sorted(demand, key=lambda lf: (-demand[lf], lf)):
        if allot[leaf]:
            continue
        if not spare:
            donor = max((lf for lf in demand if len(allot[lf]) > 1), default=None,
                        key=lambda lf: (len(allot[lf]) / demand[lf], lf))
            if donor is not None:
                spare.append(allot[donor].pop())
        if spare:
            allot[leaf].append(spare.pop(0))
            notes.append(f"leaf {leaf} has no source: borrowing {allot[leaf][0].id} across leaves")

    # Each chain: its head and its domain groups. Longest group onto the shortest chain (a heap).
    # A member is (crosses leaves, leaf, -bandwidth, first id, group): its order in the chain.
    heads: list[Instance] = []
    homes: list[str] = []
    members: list[list[tuple[bool, str, float, str, list[Instance]]]] = []
    sizes: list[int] = []
    orphans: list[tuple[str, list[Instance]]] = []

    def join(k: int, leaf: str, g: list[Instance]) -> None:
        members[k].append((leaf != homes[k], leaf, -bw(g[0]), g[0].id, g))
        sizes[k] += len(g)

    for leaf in sorted(demand):
        groups = sorted(by_leaf[leaf].values(), key=lambda g: (-len(g), g[0].id))
        if not allot[leaf]:
            orphans.extend((leaf, g) for g in groups)
            continue
        heap = []
        for s in allot[leaf]:
            heads.append(s)
            homes.append(by_name[s.node].leaf)
            members.append([])
            sizes.append(0)
            heap.append((0, s.id, len(heads) - 1))
        heapq.heapify(heap)
        for g in groups:
            _, sid, k = heap[0]
            members[k].append((leaf != homes[k], leaf, -bw(g[0]), g[0].id, g))
            sizes[k] += len(g)
            heapq.heapreplace(heap, (sizes[k], sid, k))
    live_chains = [k for k in range(len(heads)) if sizes[k]]
    if orphans:  # no source could be spared: extend the shortest chains across leaves
        if not live_chains:
            raise PlanError("no usable source for any chain")
        heap = [(sizes[k], heads[k].id, k) for k in live_chains]
        heapq.heapify(heap)
        for leaf, g in orphans:
            _, sid, k = heapq.heappop(heap)
            join(k, leaf, g)
            heapq.heappush(heap, (sizes[k], sid, k))
            notes.append(f"targets {', '.join(t.id for t in g)} appended across leaves")

    usable_ids = [s.id for s in usable]  # sorted by id
    leaf_ids: dict[str, list[str]] = {}
    for s in usable:
        leaf_ids.setdefault(by_name[s.node].leaf, []).append(s.id)

    def backups_for(head: str, home: str) -> tuple[str, ...]:
        """The chain's own source, then sources in the head's leaf, then any (by id)."""
        out = [head][:options.max_fallbacks]
        for sid in chain(leaf_ids.get(home, ()), usable_ids):
            if len(out) >= options.max_fallbacks:
                break
            if sid not in out:
                out.append(sid)
        return tuple(out)

    blocks = model.block_ids
    may_shard = options.shard and max(tgt_gpus) > 1  # a sharded hop needs a multi-GPU receiver
    flows: list[Flow] = []
    ordered: list[tuple[str, ...]] = []
    backups: dict[str, tuple[str, ...]] = {}
    for k in sorted(live_chains, key=lambda k: heads[k].id):
        head = heads[k]
        # The head's own leaf first (at most one cross-leaf hop per leaf), then by decreasing bandwidth
        # (a group's first member has its highest bandwidth), domain groups kept adjacent.
        path = [head, *(t for m in sorted(members[k], key=itemgetter(0, 1, 2, 3)) for t in m[4])]
        ids = tuple([i.id for i in path])
        ordered.append(ids)
        if may_shard and any(i.gpus > 1 for i in path):
            for a, b in pairwise(path):
                flows.extend(hop_flows(a, b, blocks, True, source_links(a, topo)))
        else:
            flows.extend(map(new_flow, ids[:-1], ids[1:], repeat(blocks)))
        backups.update(dict.fromkeys(ids[1:], backups_for(head.id, homes[k])))
    firsts = [ch[1] for ch in ordered]
    live = tuple(zip(sorted(overloaded), firsts, strict=False))
    tgt_ids = [t.id for t in tgts_by_id]
    fallbacks = tuple(zip(tgt_ids, map(backups.__getitem__, tgt_ids), strict=True))
    return Plan("chain", model, tuple(srcs_by_id), tuple(tgts_by_id), tuple(flows), tuple(ordered), fallbacks, live,
                notes=tuple(notes))
