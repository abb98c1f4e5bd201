"""The plan of one scaling operation: who sends which blocks to whom, in which order.

Data flow: a builder (chains, binomial, baselines) -> `Plan` -> `cost.predict` fills arrival times ->
`Plan.to_dict()` goes into a ScalePlan spec and to every engine, which derives from `flows` what it
receives (flows with dst == itself) and what it forwards (flows with src == itself, cut-through).
A `Flow` with a shard (i, g) carries only the i-th of g equal slices of every block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Literal

Algorithm = Literal["chain", "binomial", "hybrid", "star", "tree", "local"]
ALGORITHMS: tuple[str, ...] = ("chain", "binomial", "hybrid", "star", "tree", "local")


class PlanError(ValueError):
    """An inconsistent plan or plan document; the message names the field or instance."""


@dataclass(frozen=True)
class Instance:
    """GPUs holding (or receiving) one full copy: `gpus` = tensor-parallel degree, all on `node`.

    `kind` "host" marks a host-memory cache (a source only); "ssd" a local disk copy.
    """

    id: str
    node: str
    gpus: int = 1
    kind: Literal["gpu", "host", "ssd"] = "gpu"


@dataclass(frozen=True)
class ModelLayout:
    name: str
    block_ids: tuple[str, ...]
    block_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_bytes) or not self.block_ids:
            raise PlanError("model needs one size per block and at least one block")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise PlanError("model block ids must be unique")
        if any(b <= 0 for b in self.block_bytes):
            raise PlanError("model block sizes must be > 0")

    @property
    def total_bytes(self) -> int:
        return sum(self.block_bytes)

    @staticmethod
    def uniform(name: str, layers: int, total_bytes: int) -> ModelLayout:
        """embed + layers + head, sized like a Llama (embed and head ~ one layer each)."""
        ids = ("embed", *(f"layer.{i}" for i in range(layers)), "head")
        per = max(1, total_bytes // len(ids))
        return ModelLayout(name, ids, tuple(per for _ in ids))


@dataclass(frozen=True, slots=True)
class Flow:
    """`src` streams `blocks` to `dst` (cut-through). Slotted: plans carry thousands of flows, and
    slots make each smaller and faster to read than a per-instance dict."""

    src: str
    dst: str
    blocks: tuple[str, ...]
    shard: tuple[int, int] | None = None  # (index, count)


# The slots' own setters: they bypass the frozen `__setattr__` (which raises) without its
# `object.__setattr__` round trip per field.
_set_src, _set_dst, _set_blocks, _set_shard = (Flow.__dict__[k].__set__ for k in ("src", "dst", "blocks", "shard"))


def new_flow(src: str, dst: str, blocks: tuple[str, ...], shard: tuple[int, int] | None = None) -> Flow:
    """The same as `Flow(src, dst, blocks, shard)`, ~2x faster: it skips the frozen dataclass
    `__init__` (one `object.__setattr__` per field). For builders emitting thousands of flows."""
    f = object.__new__(Flow)
    _set_src(f, src)
    _set_dst(f, dst)
    _set_blocks(f, blocks)
    _set_shard(f, shard)
    return f


def new_flows(srcs: Iterable[str], dsts: Iterable[str], blocks: tuple[str, ...]) -> list[Flow]:
    """`[new_flow(s, d, blocks) for s, d in zip(srcs, dsts)]`, inlined (no call per flow): the
    flows share the one `blocks` tuple. For the builders' runs of same-blocks flows (chains, stripes)."""
    out: list[Flow] = []
    add, new = out.append, object.__new__
    set_src, set_dst, set_blocks, set_shard = _set_src, _set_dst, _set_blocks, _set_shard
    for src, dst in zip(srcs, dsts, strict=True):
        f = new(Flow)
        set_src(f, src)
        set_dst(f, dst)
        set_blocks(f, blocks)
        set_shard(f, None)
        add(f)
    return out


def runs(keys: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(key, start, end) of each run of equal consecutive keys. Builders list a block set's flows in
    long runs: per-run slices of the flow columns replace a dict lookup per flow."""
    start = 0
    for k, run in groupby(keys):
        end = start + len(list(run))
        yield k, start, end
        start = end


def _in_forwarding_order(srcs: Sequence[str], dsts: Sequence[str]) -> bool:
    """Is every sender a source or the receiver of an earlier flow? (Builders list flows this way;
    then there is no cycle.) Needs each receiver once and the senders to be known instances."""
    first = {d: k for k, d in enumerate(dsts)}
    get = first.get
    return all(get(s, -1) < k for k, s in enumerate(srcs))


def _feeders_reach_sources(feeder: Mapping[str, str], sources: set[str]) -> bool:
    """Does following `feeder` (receiver -> its sender) from every receiver reach a source?"""
    held = set(sources)
    for start, parent in feeder.items():
        if parent in held:  # the common case: flows listed in forwarding order
            held.add(start)
            continue
        walk: dict[str, None] = {}  # ordered set of this walk's nodes
        node = start
        while node not in held:
            if node not in feeder or node in walk:
                return False
            walk[node] = None
            node = feeder[node]
        held.update(walk)
    return True


@dataclass(frozen=True)
class Plan:
    algorithm: str
    model: ModelLayout
    sources: tuple[Instance, ...]
    targets: tuple[Instance, ...]
    flows: tuple[Flow, ...]
    chains: tuple[tuple[str, ...], ...] = ()
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    live_pairs: tuple[tuple[str, str], ...] = ()
    pipelines: tuple[tuple[str, ...], ...] = ()  # λScale execution pipelines (one member per sub-group)
    predicted: tuple[tuple[str, float], ...] = ()
    notes: tuple[str, ...] = field(default=())
    # Step-scheduled plans (binomial): per flow, the step at which each of its blocks is sent. A link
    # sends its blocks in step order; empty for plans whose flows simply stream.
    steps: tuple[tuple[int, ...], ...] = ()

    # -- queries -------------------------------------------------------------------------------
    def instance(self, iid: str) -> Instance:
        for i in (*self.sources, *self.targets):
            if i.id == iid:
                return i
        raise PlanError(f"unknown instance {iid!r}")

    def inbound(self, iid: str) -> tuple[Flow, ...]:
        return tuple(f for f in self.flows if f.dst == iid)

    def outbound(self, iid: str) -> tuple[Flow, ...]:
        return tuple(f for f in self.flows if f.src == iid)

    def fallbacks_for(self, iid: str) -> tuple[str, ...]:
        return dict(self.fallbacks).get(iid, ())

    @property
    def completion(self) -> float:
        return max((t for _, t in self.predicted), default=0.0)

    # -- checks --------------------------------------------------------------------------------
    def validate(self) -> Plan:
        """Structural invariants: known endpoints; every target gets every block exactly once
        (or every shard of it exactly once); an instance forwards a block (shard) only once it can
        hold it — a source, or fed by flows that do not depend on itself (no forwarding cycles)."""
        target_ids = {t.id for t in self.targets}
        ids = target_ids.union([s.id for s in self.sources])
        if len(ids) != len(self.sources) + len(self.targets):
            raise PlanError("instance ids must be unique across sources and targets")
        if self.steps:
            self._check_steps()
        flows = self.flows
        whole = self.model.block_ids
        # Plans carry thousands of flows: bulk checks first, on the flows as parallel columns (each
        # computed once); the detailed loops name the culprit.
        srcs, dsts, sets = [f.src for f in flows], [f.dst for f in flows], [f.blocks for f in flows]
        keys = list(map(id, sets))  # builders share one tuple per block set: its identity is the key
        blocks = dict(zip(keys, sets, strict=True))
        sharded = any([f.shard for f in flows])
        known_srcs = set(srcs) <= ids
        if (not sharded and known_srcs and all(b == whole for b in blocks.values())
                and len(set(dsts)) == len(dsts) == len(target_ids) and set(dsts) == target_ids
                and (_in_forwarding_order(srcs, dsts)
                     or _feeders_reach_sources(dict(zip(dsts, srcs, strict=True)), ids - target_ids))):
            return self  # each target receives the whole model once, along chains rooted at sources
        if not sharded and known_srcs and self._stripes_cover(blocks, keys, srcs, dsts, target_ids, ids):
            return self  # stripes: each target receives each disjoint block set once, along trees from sources
        if not (known_srcs and set(dsts) <= target_ids
                and all(f.shard is None or 0 <= f.shard[0] < f.shard[1] for f in flows)):
            for k, f in enumerate(flows):
                if f.src not in ids or f.dst not in ids:
                    raise PlanError(f"flows[{k}]: unknown endpoint {f.src!r} -> {f.dst!r}")
                if f.dst not in target_ids:
                    raise PlanError(f"flows[{k}]: destination {f.dst!r} is not a target")
                if f.shard is not None and not 0 <= f.shard[0] < f.shard[1]:
                    raise PlanError(f"flows[{k}]: shard {f.shard} out of range")
        if all(b == whole for b in blocks.values()):
            self._check_whole_coverage()
            self._check_causal(whole, None)
            return self
        self._check_block_coverage()
        per_block: dict[str, list[int]] = {}
        for k, f in enumerate(flows):
            for b in f.blocks:
                per_block.setdefault(b, []).append(k)
        for b, ks in per_block.items():
            self._check_causal((b,), ks)
        return self

    def _stripes_cover(self, sets: Mapping[int, tuple[str, ...]], keys: Sequence[int], srcs: Sequence[str],
                       dsts: Sequence[str], target_ids: set[str], ids: set[str]) -> bool:
        """Fast sufficient check for striped plans (few distinct block sets, shared by identity): the
        sets partition the model, and per set every target is fed exactly once along a tree that
        reaches a source. Flow k carries the set `sets[keys[k]]` from srcs[k] to dsts[k]. False sends
        the plan to the detailed checks."""
        if len(sets) > 64 or sum(len(b) for b in sets.values()) != len(self.model.block_ids):
            return False
        if set().union(*sets.values()) != set(self.model.block_ids):
            return False
        feeders: dict[int, dict[str, str]] = {k: {} for k in sets}
        for k, start, end in runs(keys):
            feeders[k].update(zip(dsts[start:end], srcs[start:end], strict=True))
        if sum(map(len, feeders.values())) != len(keys):
            return False  # some target is fed one set twice
        sources = ids - target_ids
        return all(tree.keys() == target_ids and _feeders_reach_sources(tree, sources) for tree in feeders.values())

    def _check_steps(self) -> None:
        """One step per block of every flow, and a relay sends a block only at a later step than the
        one it receives it at (the step order is an execution order, not just a label)."""
        if len(self.steps) != len(self.flows):
            raise PlanError(f"steps: {len(self.steps)} entries for {len(self.flows)} flows")
        # (receiver, block, shard slot; -1 the whole block) -> the step it arrives at
        got: dict[tuple[str, str, int], int] = {}
        for k, (f, st) in enumerate(zip(self.flows, self.steps, strict=True)):
            if len(st) != len(f.blocks) or any(s < 0 for s in st):
                raise PlanError(f"steps[{k}]: needs one step >= 0 per block of flows[{k}]")
            slot = f.shard[0] if f.shard else -1
            for b, s in zip(f.blocks, st, strict=True):
                key = (f.dst, b, slot)
                got[key] = max(got.get(key, -1), s)
        sources = {s.id for s in self.sources}
        for k, (f, st) in enumerate(zip(self.flows, self.steps, strict=True)):
            if f.src in sources:
                continue
            slot = f.shard[0] if f.shard else -1
            for b, s in zip(f.blocks, st, strict=True):
                if got.get((f.src, b, slot), got.get((f.src, b, -1), s)) >= s:
                    raise PlanError(f"steps[{k}]: {f.src!r} sends block {b!r} at step {s}, before it holds it")

    def _check_whole_coverage(self) -> None:
        """Every flow carries the whole model (the common case): per target, one unsharded flow or
        shards 0..g-1 of one count g, each once."""
        if all(f.shard is None for f in self.flows):  # fast path: one flow per target?
            dsts = [f.dst for f in self.flows]
            if len(dsts) == len(set(dsts)) == len(self.targets):  # dsts are targets (checked)
                return
        got: dict[str, list[tuple[int, int] | None]] = {t.id: [] for t in self.targets}
        for f in self.flows:
            got[f.dst].append(f.shard)
        for t, shards in got.items():
            if shards == [None]:
                continue
            if not shards:
                raise PlanError(f"target {t!r} never receives all of block {self.model.block_ids[0]!r}")
            counts = {s[1] if s else 1 for s in shards}
            if len(counts) != 1:
                raise PlanError(f"target {t!r} receives the model in shards of different counts")
            indices = sorted(s[0] if s else 0 for s in shards)
            if len(set(indices)) != len(indices):
                raise PlanError(f"{t!r} receives the model (shard {indices}) twice")
            if len(indices) != counts.pop():
                raise PlanError(f"target {t!r} never receives all of block {self.model.block_ids[0]!r} "
                                f"(shards {indices})")

    def _check_block_coverage(self) -> None:
        got: dict[tuple[str, str], dict[int, set[int]]] = {}
        blocks = set(self.model.block_ids)
        for k, f in enumerate(self.flows):
            index, count = f.shard or (0, 1)
            for b in f.blocks:
                if b not in blocks:
                    raise PlanError(f"flows[{k}]: unknown block {b!r}")
                have = got.setdefault((f.dst, b), {}).setdefault(count, set())
                if index in have:
                    raise PlanError(f"flows[{k}]: {f.dst!r} receives block {b!r} (shard {index}) twice")
                have.add(index)
        for t in self.targets:
            for b in self.model.block_ids:
                shards = got.get((t.id, b), {})
                if len(shards) != 1 or len(next(iter(shards.values()))) != next(iter(shards), 0):
                    raise PlanError(f"target {t.id!r} never receives all of block {b!r} "
                                    "(or receives it in shards of different counts)")

    def _check_causal(self, blocks: tuple[str, ...], ks: Sequence[int] | None) -> None:
        """Check that the flows `ks` (None: all) carrying `blocks` (as one unit) can all fire: a
        flow fires once its sender holds what it sends (that shard, or the whole block after an
        all-gather). A flow that never fires forwards something its sender never holds."""
        src_ids = {s.id for s in self.sources}
        flows = self.flows
        chosen = flows if ks is None else [flows[k] for k in ks]
        # Fast sufficient test: per shard slot, every receiver's feeder chain reaches a source
        # (coverage gave every receiver exactly one feeder per slot).
        trees: dict[tuple[int, int] | None, dict[str, str]] = {}
        for f in chosen:
            tree = trees.get(f.shard)
            if tree is None:
                tree = trees[f.shard] = {}
            tree[f.dst] = f.src
        if all(_feeders_reach_sources(tree, src_ids) for tree in trees.values()):
            return
        # Exact: propagate holdings from the sources.
        idx = range(len(flows)) if ks is None else ks
        count = {flows[k].dst: (flows[k].shard or (0, 1))[1] for k in idx}
        have: dict[str, set[int]] = {}
        out: dict[str, list[int]] = {}
        for k in idx:
            out.setdefault(flows[k].src, []).append(k)
        fired: set[int] = set()

        def can_send(k: int) -> bool:
            f = flows[k]
            if f.src in src_ids:
                return True
            mine = have.get(f.src, set())
            if f.src in count and len(mine) == count[f.src]:
                return True
            return f.shard is not None and f.shard[1] == count.get(f.src) and f.shard[0] in mine

        todo = [k for s in src_ids for k in out.get(s, [])]
        while todo:
            k = todo.pop()
            if k in fired or not can_send(k):
                continue
            fired.add(k)
            f = flows[k]
            have.setdefault(f.dst, set()).add(f.shard[0] if f.shard else 0)
            todo.extend(j for j in out.get(f.dst, []) if j not in fired)
        for k in idx:
            if k not in fired:
                raise PlanError(f"flows[{k}]: {flows[k].src!r} forwards block {blocks[0]!r} it never holds "
                                "(a forwarding cycle, or it never receives it)")

    # -- wire format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def inst(i: Instance) -> dict[str, Any]:
            return {"id": i.id, "node": i.node, "gpus": i.gpus, "kind": i.kind}

        return {
            "algorithm": self.algorithm,
            "model": {"name": self.model.name, "blockIds": list(self.model.block_ids),
                      "blockBytes": list(self.model.block_bytes)},
            "sources": [inst(i) for i in self.sources],
            "targets": [inst(i) for i in self.targets],
            "flows": [{"src": f.src, "dst": f.dst, "blocks": list(f.blocks),
                       **({"shard": list(f.shard)} if f.shard else {})} for f in self.flows],
            "chains": [list(c) for c in self.chains],
            "fallbacks": {t: list(s) for t, s in self.fallbacks},
            "livePairs": [list(p) for p in self.live_pairs],
            "pipelines": [list(p) for p in self.pipelines],
            "predicted": dict(self.predicted),
            "notes": list(self.notes),
            **({"steps": [list(x) for x in self.steps]} if self.steps else {}),
        }

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> Plan:
        try:
            m = doc["model"]
            def inst(d: Mapping[str, Any]) -> Instance:
                kind = d.get("kind", "gpu")
                if kind not in ("gpu", "host", "ssd"):
                    raise ValueError(f"instance kind {kind!r}")
                return Instance(str(d["id"]), str(d["node"]), int(d.get("gpus", 1)), kind)

            plan = Plan(
                algorithm=str(doc["algorithm"]),
                model=ModelLayout(str(m["name"]), tuple(m["blockIds"]), tuple(int(x) for x in m["blockBytes"])),
                sources=tuple(inst(d) for d in doc["sources"]),
                targets=tuple(inst(d) for d in doc["targets"]),
                flows=tuple(Flow(str(f["src"]), str(f["dst"]), tuple(f["blocks"]),
                                 (int(f["shard"][0]), int(f["shard"][1])) if f.get("shard") else None)
                            for f in doc["flows"]),
                chains=tuple(tuple(c) for c in doc.get("chains", [])),
                fallbacks=tuple((str(t), tuple(s)) for t, s in dict(doc.get("fallbacks", {})).items()),
                live_pairs=tuple((str(a), str(b)) for a, b in doc.get("livePairs", [])),
                pipelines=tuple(tuple(p) for p in doc.get("pipelines", [])),
                predicted=tuple((str(t), float(v)) for t, v in dict(doc.get("predicted", {})).items()),
                notes=tuple(str(n) for n in doc.get("notes", [])),
                steps=tuple(tuple(int(s) for s in x) for x in doc.get("steps", [])),
            )
        except KeyError as e:
            raise PlanError(f"plan document: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, IndexError) as e:
            raise PlanError(f"plan document: malformed ({e})") from None
        if plan.algorithm not in ALGORITHMS:
            raise PlanError(f"plan document: unknown algorithm {plan.algorithm!r}")
        return plan.validate()
