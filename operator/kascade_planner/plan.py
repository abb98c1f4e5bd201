"""The plan of one scaling operation: who sends which blocks to whom, in which order.

Data flow: a builder (chains, binomial, baselines) -> `Plan` -> `cost.predict` fills arrival times ->
`Plan.to_dict()` goes into a ScalePlan spec and to every engine, which derives from `flows` what it
receives (flows with dst == itself) and what it forwards (flows with src == itself, cut-through).
A `Flow` with a shard (i, g) carries only the i-th of g equal slices of every block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Algorithm = Literal["chain", "binomial", "star", "tree", "local"]
ALGORITHMS: tuple[str, ...] = ("chain", "binomial", "star", "tree", "local")


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


@dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    blocks: tuple[str, ...]
    shard: tuple[int, int] | None = None  # (index, count)


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
        (or every shard of it exactly once); only instances that receive a block forward it."""
        ids = {i.id for i in (*self.sources, *self.targets)}
        if len(ids) != len(self.sources) + len(self.targets):
            raise PlanError("instance ids must be unique across sources and targets")
        blocks = set(self.model.block_ids)
        whole = self.model.block_ids
        # Per target: shards received as whole-model flows (the common case, checked in O(1)), and
        # per-block shards for partial flows.
        full: dict[str, dict[int, set[int]]] = {t.id: {} for t in self.targets}
        part: dict[str, dict[str, dict[int, set[int]]]] = {t.id: {} for t in self.targets}
        for k, f in enumerate(self.flows):
            if f.src not in ids or f.dst not in ids:
                raise PlanError(f"flows[{k}]: unknown endpoint {f.src!r} -> {f.dst!r}")
            if f.dst not in full:
                raise PlanError(f"flows[{k}]: destination {f.dst!r} is not a target")
            index, count = f.shard or (0, 1)
            if not 0 <= index < count:
                raise PlanError(f"flows[{k}]: shard {f.shard} out of range")
            if f.blocks == whole:
                got = full[f.dst].setdefault(count, set())
                if index in got:
                    raise PlanError(f"flows[{k}]: {f.dst!r} receives the model (shard {index}) twice")
                got.add(index)
                continue
            for b in f.blocks:
                if b not in blocks:
                    raise PlanError(f"flows[{k}]: unknown block {b!r}")
                got = part[f.dst].setdefault(b, {}).setdefault(count, set())
                if index in got:
                    raise PlanError(f"flows[{k}]: {f.dst!r} receives block {b!r} (shard {index}) twice")
                got.add(index)
        for t in self.targets:
            if not part[t.id] and len(full[t.id]) == 1:
                ((count, got),) = full[t.id].items()
                if len(got) == count:
                    continue
            for b in self.model.block_ids:
                merged: dict[int, set[int]] = {c: set(v) for c, v in full[t.id].items()}
                for c, v in part[t.id].get(b, {}).items():
                    if merged.setdefault(c, set()) & v:
                        raise PlanError(f"{t.id!r} receives block {b!r} twice")
                    merged[c] |= v
                if len(merged) != 1 or len(next(iter(merged.values()))) != next(iter(merged)):
                    raise PlanError(f"target {t.id!r} never receives all of block {b!r} "
                                    "(or receives it in shards of different counts)")
        src_ids = {s.id for s in self.sources}
        for k, f in enumerate(self.flows):
            if f.src not in src_ids and f.src not in full:
                raise PlanError(f"flows[{k}]: {f.src!r} forwards blocks it never receives")
        return self

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
            )
        except KeyError as e:
            raise PlanError(f"plan document: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, IndexError) as e:
            raise PlanError(f"plan document: malformed ({e})") from None
        if plan.algorithm not in ALGORITHMS:
            raise PlanError(f"plan document: unknown algorithm {plan.algorithm!r}")
        return plan.validate()
