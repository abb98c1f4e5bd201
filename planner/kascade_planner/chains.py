"""BlitzScale multi-chain multicast (§5.1): serial forwarding chains S -> T1 -> ... -> Tn.

Data flow: (topology, sources, targets, KV flows) -> prune sources whose egress already carries a
flow (direction-aware interference) -> allot sources to leaves (leaf-local first) -> group each leaf's
targets by scale-up domain and deal the groups to that leaf's chains, longest group first onto the
shortest chain -> order each chain by decreasing bandwidth -> flows (sharded g-wide when both ends
have g GPUs). Phases: `_targets_by_leaf`, `_allot_sources`, `_deal_groups` (into `Chain`s), then
flows and fallbacks in `build_chains`. A chain costs about |M|/B_min + (n-1)·chunk/B_min, nearly
independent of n; the tail of every chain is the next scaling round's source (the parameter pool grows with finished
targets).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise
from operator import attrgetter, itemgetter

from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError, new_flow, new_flows
from kascade_planner.topology import Node, Topology


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


def source_gbps(topo: Topology, src: Instance) -> float:
    """What a source sends one target at, as the cost model charges a remote hop from it (`cost.pair_gbps`): a
    GPU instance its NICs; a host-memory copy min(NIC, PCIe) per link (host memory reaches a NIC over PCIe); an
    SSD copy min(NIC, SSD). Ranked by NIC alone, a host copy tied a GPU on a fast network and won by id, so every
    load ran at PCIe speed."""
    nic = topo.by_name[src.node].nic_gbps
    per = nic if src.kind == "gpu" else min(nic, topo.pcie_gbps if src.kind == "host" else topo.ssd_gbps)
    return per * src.gpus


def hop_flows(
    src: Instance, dst: Instance, blocks: tuple[str, ...], shard: bool, links: int | None = None
) -> list[Flow]:
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


@dataclass
class Chain:
    """One chain under construction: its head (a source), the head's leaf, and the domain groups
    dealt to it. A member is (crosses leaves, leaf, -bandwidth, first id, group): its sort key."""

    head: Instance
    home: str
    members: list[tuple[bool, str, float, str, list[Instance]]] = field(default_factory=list)
    size: int = 0

    def join(self, leaf: str, group: list[Instance], bandwidth: float) -> None:
        self.members.append((leaf != self.home, leaf, -bandwidth, group[0].id, group))
        self.size += len(group)

    def path(self) -> list[Instance]:
        """The head's own leaf first (at most one cross-leaf hop per leaf), then by decreasing
        bandwidth (a group's first member has its highest), domain groups kept adjacent."""
        return [self.head, *(t for m in sorted(self.members, key=itemgetter(0, 1, 2, 3)) for t in m[4])]


def _targets_by_leaf(tgts_by_id: list[Instance], by_name: Mapping[str, Node],
                     bw: Callable[[Instance], float]) -> dict[str, dict[str, list[Instance]]]:
    """Phase 1: targets by leaf, then by scale-up domain (a domain's targets stay adjacent in one
    chain), each in decreasing bandwidth, then id. On one node bandwidth differs only by GPU count."""
    by_node: dict[str, list[Instance]] = {}
    for t in tgts_by_id:
        on_node = by_node.get(t.node)
        if on_node is None:
            by_node[t.node] = [t]
        else:
            on_node.append(t)
    if len({t.gpus for t in tgts_by_id}) > 1:
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
    return by_leaf


def _allot_sources(demand: Mapping[str, int], src_by_leaf: Mapping[str, list[Instance]],
                   notes: list[str]) -> dict[str, list[Instance]]:
    """Phase 2: each leaf with targets keeps its own sources; leaves without any borrow spare sources
    from leaves with the most sources per target (one cross-leaf hop per chain at most)."""
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
    return allot


def _deal_groups(by_leaf: Mapping[str, Mapping[str, list[Instance]]], allot: Mapping[str, list[Instance]],
                 by_name: Mapping[str, Node], bw: Callable[[Instance], float], notes: list[str]) -> list[Chain]:
    """Phase 3: one chain per allotted source; each leaf's domain groups go longest first onto its
    shortest chain (a heap); groups of leaves no source could serve extend the shortest chains."""
    chains: list[Chain] = []
    orphans: list[tuple[str, list[Instance]]] = []
    for leaf in sorted(by_leaf):
        groups = sorted(by_leaf[leaf].values(), key=lambda g: (-len(g), g[0].id))
        if not allot[leaf]:
            orphans.extend((leaf, g) for g in groups)
            continue
        ranked: list[tuple[int, int, int]] = []
        for rank, s in enumerate(allot[leaf]):  # allotted fastest first: equal chains go to the faster head
            chains.append(Chain(s, by_name[s.node].leaf))
            ranked.append((0, rank, len(chains) - 1))
        heapq.heapify(ranked)
        for g in groups:
            _, rank, k = ranked[0]
            chains[k].join(leaf, g, bw(g[0]))
            heapq.heapreplace(ranked, (chains[k].size, rank, k))
    live = [k for k, c in enumerate(chains) if c.size]
    if orphans:
        if not live:
            raise PlanError("no usable source for any chain")
        heap = [(chains[k].size, chains[k].head.id, k) for k in live]
        heapq.heapify(heap)
        for leaf, g in orphans:
            _, sid, k = heapq.heappop(heap)
            chains[k].join(leaf, g, bw(g[0]))
            heapq.heappush(heap, (chains[k].size, sid, k))
        # One note, not one per group (thousands at datacenter scale): how many, and the first few.
        moved = [t.id for _, g in orphans for t in g]
        more = f" and {len(moved) - 8} more" if len(moved) > 8 else ""
        notes.append(f"targets {', '.join(moved[:8])}{more} appended across leaves")
    return sorted((c for c in chains if c.size), key=lambda c: c.head.id)


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

    by_leaf = _targets_by_leaf(tgts_by_id, by_name, bw)
    src_by_leaf: dict[str, list[Instance]] = defaultdict(list)
    # Fastest sender first (ties: GPU copies before host and SSD ones, then id): the leaf's first source
    # heads the first chain, and with one target it is the only one used.
    for s in sorted(usable, key=lambda s: (-source_gbps(topo, s), s.kind != "gpu", s.id)):
        src_by_leaf[by_name[s.node].leaf].append(s)
    allot = _allot_sources({leaf: sum(len(g) for g in doms.values()) for leaf, doms in by_leaf.items()},
                           src_by_leaf, notes)
    chains = _deal_groups(by_leaf, allot, by_name, bw, notes)

    # Phase 4: flows along each chain (sharded g-wide where both ends allow), fallbacks per target.
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
    may_shard = options.shard and max(t.gpus for t in tgts_by_id) > 1  # a sharded hop needs a multi-GPU receiver
    flows: list[Flow] = []
    ordered: list[tuple[str, ...]] = []
    backups: dict[str, tuple[str, ...]] = {}
    for c in chains:
        path = c.path()
        ids = tuple([i.id for i in path])
        ordered.append(ids)
        if may_shard and any(i.gpus > 1 for i in path):
            for a, b in pairwise(path):
                flows.extend(hop_flows(a, b, blocks, True, source_links(a, topo)))
        else:
            flows.extend(new_flows(ids[:-1], ids[1:], blocks))
        backups.update(dict.fromkeys(ids[1:], backups_for(c.head.id, c.home)))
    firsts = [ch[1] for ch in ordered]
    live = tuple(zip(sorted(overloaded), firsts, strict=False))
    tgt_ids = [t.id for t in tgts_by_id]
    fallbacks = tuple(zip(tgt_ids, map(backups.__getitem__, tgt_ids), strict=True))
    return Plan("chain", model, tuple(srcs_by_id), tuple(tgts_by_id), tuple(flows), tuple(ordered), fallbacks, live,
                notes=tuple(notes))
