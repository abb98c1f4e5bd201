"""The shared pool: empty engines per node class that can bind any model, and target choice across models
(issue 35 item 1).

Data flow: the fleet's node classes (`NodeClass`: GPU type, memory per GPU, GPUs per engine) + its empty engines
(`EmptyEngine`: node, class, leaf, the model whose host copy its node keeps) + each model's requirement
(`ModelNeed`: GPUs, memory, allowed GPU types) + what each model is granted this round, in arbitration order
(`Want`, from `arbitration.arbitrate`) -> `choose_fleet_targets` (pure, deterministic) -> `FleetChoice`: the
engines each model binds, and for a model that got fewer than granted, why.

Preference for a model's next engine, first difference wins:
1. an engine on a node that keeps a host copy of this model (the load is a local PCIe copy, no network);
2. not an engine on a node that keeps another model's host copy (binding there evicts nothing, but the node's
   host budget is that model's scale-from-zero source: leave those nodes to it while others are free);
3. best fit: the least GPU memory left over (a small model does not take the class a large one needs), then
   the fewest GPUs;
4. an engine in a leaf of one of the model's sources (its chain stays under one switch);
5. the engine id.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _check(what: str, *, name: tuple[str, str], memory_gib: tuple[str, float], gpus: tuple[str, int]) -> None:
    """The shared checks of a node class and a model need: a name, a finite memory > 0, at least one GPU;
    the error names the field and the value."""
    if not name[1]:
        raise ValueError(f"{name[0]} must be non-empty")
    if not (memory_gib[1] > 0 and math.isfinite(memory_gib[1])):
        raise ValueError(f"{what}: {memory_gib[0]} must be a finite number > 0, got {memory_gib[1]}")
    if gpus[1] < 1:
        raise ValueError(f"{what}: {gpus[0]} must be >= 1, got {gpus[1]}")


@dataclass(frozen=True)
class NodeClass:
    name: str
    gpu_type: str
    gpu_memory_gib: float  # per GPU
    gpus_per_engine: int = 1

    def __post_init__(self) -> None:
        _check(f"node class {self.name}", name=("NodeClass.name", self.name),
               memory_gib=("gpu_memory_gib", self.gpu_memory_gib), gpus=("gpus_per_engine", self.gpus_per_engine))

    @property
    def memory_gib(self) -> float:
        return self.gpu_memory_gib * self.gpus_per_engine


@dataclass(frozen=True)
class ModelNeed:
    """What one replica of a model needs: GPUs, GPU memory (weights plus the KV it must hold), GPU types."""

    model: str
    memory_gib: float
    gpus: int = 1
    gpu_types: tuple[str, ...] = ()  # empty: any type

    def __post_init__(self) -> None:
        _check(f"model {self.model}", name=("ModelNeed.model", self.model), memory_gib=("memory_gib", self.memory_gib),
               gpus=("gpus", self.gpus))


def fits(cls: NodeClass, need: ModelNeed) -> str | None:
    """None when an engine of `cls` can serve `need`; else why not."""
    if need.gpu_types and cls.gpu_type not in need.gpu_types:
        return f"{cls.name}: GPU type {cls.gpu_type} not in {', '.join(need.gpu_types)}"
    if cls.gpus_per_engine < need.gpus:
        return f"{cls.name}: {cls.gpus_per_engine} GPU(s) per engine, {need.model} needs {need.gpus}"
    if cls.memory_gib < need.memory_gib:
        return f"{cls.name}: {cls.memory_gib:g} GiB per engine, {need.model} needs {need.memory_gib:g}"
    return None


@dataclass(frozen=True)
class EmptyEngine:
    id: str
    node: str
    node_class: str
    leaf: str | None = None
    host_copy: str | None = None  # the model whose host copy this engine's node keeps (node-level cache)


@dataclass(frozen=True)
class Want:
    model: str
    count: int
    source_leaves: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class FleetChoice:
    targets: tuple[tuple[str, tuple[str, ...]], ...]  # (model, engine ids), in the wants' order
    unmet: tuple[tuple[str, int, str], ...]  # (model, engines it did not get, why)

    def of(self, model: str) -> tuple[str, ...]:
        return dict(self.targets).get(model, ())


def choose_fleet_targets(pool: Sequence[EmptyEngine], classes: Mapping[str, NodeClass],
                         needs: Mapping[str, ModelNeed], wants: Sequence[Want]) -> FleetChoice:
    """Bind empty engines to the models granted them, in the wants' order (the arbitration's ranking)."""
    for e in pool:
        if e.node_class not in classes:
            raise ValueError(f"engine {e.id}: node class {e.node_class!r} is not one of {', '.join(sorted(classes))}")
    left = {e.id: e for e in pool}
    targets: list[tuple[str, tuple[str, ...]]] = []
    unmet: list[tuple[str, int, str]] = []
    for w in wants:
        if w.count < 0:
            raise ValueError(f"want for {w.model}: count must be >= 0, got {w.count}")
        need = needs.get(w.model)
        if need is None:
            raise ValueError(f"want for {w.model}: no ModelNeed for that model")
        usable = [e for e in left.values() if fits(classes[e.node_class], need) is None]
        usable.sort(key=lambda e: _preference(e, classes[e.node_class], need, w))
        chosen = tuple(e.id for e in usable[:w.count])
        for i in chosen:
            del left[i]
        targets.append((w.model, chosen))
        if len(chosen) < w.count:
            misfits = sorted({r for e in left.values() if (r := fits(classes[e.node_class], need)) is not None})
            why = f"{len(chosen)} of {w.count} empty engines fit" + (f" (others: {'; '.join(misfits)})"
                                                                    if misfits else " (no empty engine left)")
            unmet.append((w.model, w.count - len(chosen), why))
    return FleetChoice(tuple(targets), tuple(unmet))


def _preference(e: EmptyEngine, cls: NodeClass, need: ModelNeed, w: Want) -> tuple[int, int, float, int, int, str]:
    return (0 if e.host_copy == need.model else 1,
            1 if e.host_copy not in (None, need.model) else 0,
            cls.memory_gib - need.memory_gib, cls.gpus_per_engine,
            0 if e.leaf in w.source_leaves else 1, e.id)
