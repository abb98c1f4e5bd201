"""Which idle engines of the shared pool a service binds: the planner's fleet target choice
(`kascade_planner.fleet.choose_fleet_targets`) on the round's pool view, PURE (decide() builds a `FleetTargets`
from the World and hands its `choose` to the reconciler).

Why: the pool's idle engines are not interchangeable. An engine on a node of the wrong GPU type (the service's
`spec.engine.nodeSelector`, GPU Feature Discovery's `nvidia.com/gpu.product` among it) cannot serve the model;
an engine on a node that already keeps the model's host copy adds no host memory for it (with the node cache
every engine of the node maps the one copy, ADR 16), and one on a node keeping another model's copy is that
model's scale-from-zero source, best left to it while others are free.

Data flow: the World's idle pods (`PodView`: node, leaf, tp, host copy) + the labels of their nodes (node
facts: `nvidia.com/gpu.product`, `nvidia.com/gpu.memory` in MiB, the selector's keys) + the service's model,
tp, nodeSelector and gpuMemoryGiB + the pods keeping host copies (per node with the node cache, per pod without) ->
`EmptyEngine`s in `NodeClass`es and one `Want` (this service's, the leaves of its serving replicas as the
chain's sources) -> `choose_fleet_targets` -> the pods, best first. The preference order is the planner's
(kascade_planner/fleet.py); ties keep the pool's old order (leaf, node, name: a node's engines stay adjacent).

Without the node cache a pod's host copy is its own: binding it as a chain target drops the copy, so a pod
keeping this model's copy is chosen last (it sends as a host source instead), as `pool.choose_targets` did.
A node this operator does not know yet (not in its node list) fits no selector (a later round, once the node
watch shows it, decides); one without the GPU labels is of class `unlabelled`.
The model's GPU memory need is `spec.engine.gpuMemoryGiB` (over its tp GPUs): set, an engine on a node whose
GPUs (`nvidia.com/gpu.memory` x tp) hold less, or whose node does not say, is not bound; unset, every class fits
by memory. Either way the planner's best fit prefers the least memory left over (the large GPUs stay free for
whoever needs them).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kascade_operator import labels as L
from kascade_operator.pool import PodView, usable_target
from kascade_planner.fleet import EmptyEngine, ModelNeed, NodeClass, Want, choose_fleet_targets

ANY_MEMORY_GIB = 1e-6  # a model need that every class fits (no memory need stated; the CRD minimum is 0.001)
UNKNOWN_MEMORY_GIB = 1e-6  # a node that does not say its GPU memory: fits only a need not stated


def node_class(labels: Mapping[str, str], gpus: int = 1) -> NodeClass:
    """The class of a node's engines from its GPU Feature Discovery labels (GPU type, memory per GPU)."""
    product = labels.get(L.GPU_PRODUCT) or ""
    mib = labels.get(L.GPU_MEMORY) or ""
    gib = int(mib) / 1024 if mib.isdigit() and int(mib) > 0 else UNKNOWN_MEMORY_GIB
    name = f"{product or 'unlabelled'}/{mib if gib != UNKNOWN_MEMORY_GIB else '?'}MiB/x{gpus}"
    return NodeClass(name, product or "unlabelled", gib, gpus)


def selects(selector: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    """The node (its labels; None: not known to this operator) may run the service's engines."""
    return not selector or (labels is not None and all(labels.get(k) == v for k, v in selector.items()))


@dataclass(frozen=True)
class FleetTargets:
    """What the target choice needs of one round, from its World (decide builds it)."""

    model: str
    tp: int = 1
    selector: Mapping[str, str] = field(default_factory=dict)  # spec.engine.nodeSelector
    memory_gib: float | None = None  # spec.engine.gpuMemoryGiB (None: not stated, every class fits)
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # node -> labels (pods' nodes)
    node_cache: bool = False  # the pool's engines share one host copy per node (settings.node_cache)
    copies: Mapping[str, frozenset[str]] = field(default_factory=dict)  # node -> models kept there (node cache)

    @staticmethod
    def of(model: str, tp: int, selector: Mapping[str, str] | None, node_labels: Mapping[str, Mapping[str, str]],
           node_cache: bool, pods: Sequence[PodView], memory_gib: float | None = None) -> FleetTargets:
        """`pods`: the round's pool view; every pod recording a host copy counts for its node (node cache)."""
        copies: dict[str, set[str]] = {}
        if node_cache:
            for p in pods:
                if p.host_copy and p.node and p.created_for is None:
                    copies.setdefault(p.node, set()).add(p.host_copy)
        return FleetTargets(model, tp, dict(selector or {}), memory_gib, node_labels, node_cache,
                            {n: frozenset(m) for n, m in copies.items()})

    def host_copy(self, p: PodView) -> str | None:
        """The model whose host copy `p`'s node (node cache) or `p` itself keeps; this model first."""
        kept = self.copies.get(p.node or "", frozenset()) if self.node_cache else \
            frozenset({p.host_copy} if p.host_copy else ())
        return self.model if self.model in kept else min(kept, default=None)

    def choose(self, idle: Sequence[PodView], k: int, source_leaves: Collection[str | None]) -> list[PodView]:
        """Up to `k` targets among `idle` (the reconciler's chooser: same arguments as `pool.choose_targets`)."""
        if k <= 0:
            return []
        usable = [p for p in idle if usable_target(p) and selects(self.selector, self.node_labels.get(p.node or ""))]
        # without the node cache a pod's own copy of this model is a host source, not a target: those come last
        own = [p for p in usable if not self.node_cache and p.host_copy == self.model]
        rest = [p for p in usable if not (not self.node_cache and p.host_copy == self.model)]
        out = self._choose(rest, k, source_leaves)
        return out + self._choose(own, k - len(out), source_leaves)

    def _choose(self, pods: Sequence[PodView], k: int, source_leaves: Collection[str | None]) -> list[PodView]:
        if k <= 0 or not pods:
            return []
        classes: dict[str, NodeClass] = {}
        engines: list[EmptyEngine] = []
        by_id: dict[str, PodView] = {}
        for p in pods:
            cls = node_class(self.node_labels.get(p.node or "") or {}, p.tp)
            classes[cls.name] = cls
            eid = f"{p.leaf or ''}\x00{p.node or ''}\x00{p.pod_name}"  # the id breaks ties: leaf, node, name
            by_id[eid] = p
            engines.append(EmptyEngine(eid, p.node or "", cls.name, p.leaf, self.host_copy(p)))
        gpu = self.selector.get(L.GPU_PRODUCT)
        need = ModelNeed(self.model, self.memory_gib or ANY_MEMORY_GIB, self.tp, (gpu,) if gpu else ())
        leaves = tuple(sorted({x for x in source_leaves if x is not None}))
        choice = choose_fleet_targets(engines, classes, {self.model: need}, [Want(self.model, k, leaves)])
        return [by_id[i] for i in choice.of(self.model)]
