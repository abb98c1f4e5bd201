"""The pool and the ScalePlans of a namespace, grouped once per change and shared by every round.

Why: a round needs its own service's pods, the idle ones (targets, host copies), the pods keeping its model
in host memory, and which pods unfinished plans hold. Parsing and scanning the whole pool and every plan in
each round made a round's cost grow with the number of services (200 services: 3.9 ms of CPU per round
against 0.5 ms at 20; bench/round_cpu.py). Here the watch's objects are grouped once per change of the
index, and a round reads its groups in O(its own pods + idle pods).

Change detection without a hook into kopf: the index hands out the same dict object until the object
changes (each watch event stores a new one), so the tuple of the objects' ids is the snapshot's version.
The cached snapshot keeps references to those objects, so an id cannot be reused by a new object while it
is cached. Comparing the ids is one C-level pass (microseconds at a thousand pods).

Data flow: kopf index (pool pods / ScalePlans of one namespace) -> `pool()` / `plans()` (cached by the
ids) -> `PoolSnapshot.select(service key, model)` / `PlanSnapshot.of(service)`, `.held` -> observe.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kascade_operator.pool import PodView, usable_target
from kascade_operator.reconcile import TERMINAL

Raw = Mapping[str, Any]


@dataclass(frozen=True)
class PoolSnapshot:
    raw: tuple[Raw, ...]
    views: Mapping[int, PodView]  # raw index -> view (a pod being deleted has none), draining marked drained
    by_service: Mapping[str, tuple[int, ...]]  # service key -> raw indexes of the pods bound to it
    unbound: tuple[int, ...]  # idle pods, and pods being deleted (their serving gate closes)
    copies: Mapping[str, tuple[int, ...]]  # model -> pods recorded as keeping it in host memory
    # arbitration entry -> draining pods preempted for it (fleetboard.py), and the idle pods any service may bind
    preempted: Mapping[str, int] = field(default_factory=dict)
    free: tuple[int, ...] = ()

    def select(self, key: str, model: str) -> tuple[list[PodView], list[Raw]]:
        """What one service's round reads, in pool order: its pods, the idle ones, the model's host copies."""
        idx = sorted({*self.by_service.get(key, ()), *self.unbound, *self.copies.get(model, ())})
        return [self.views[i] for i in idx if i in self.views], [self.raw[i] for i in idx]

    def free_count(self, taken: frozenset[str] | set[str]) -> int:
        """Idle pool pods any service may bind (not a fallback pod of one), less those plans or claims hold."""
        return sum(1 for i in self.free if self.views[i].pod_name not in taken)


def group_pool(raw: Sequence[Raw], views: Sequence[PodView | None]) -> PoolSnapshot:
    """`views[i]`: the view of `raw[i]`, or None for a pod being deleted."""
    by: dict[str, list[int]] = {}
    unbound: list[int] = []
    copies: dict[str, list[int]] = {}
    out: dict[int, PodView] = {}
    preempted: dict[str, int] = {}
    free: list[int] = []
    for i, v in enumerate(views):
        if v is None:
            unbound.append(i)
            continue
        out[i] = replace(v, drained=True) if v.draining else v
        if v.model_service is None:
            unbound.append(i)
            if v.pool and not v.draining and v.created_for is None and usable_target(v):
                free.append(i)
        else:
            by.setdefault(v.model_service, []).append(i)
            if v.draining and v.preempted_for:
                preempted[v.preempted_for] = preempted.get(v.preempted_for, 0) + 1
        if v.host_copy:
            copies.setdefault(v.host_copy, []).append(i)
    return PoolSnapshot(tuple(raw), out, {k: tuple(v) for k, v in by.items()}, tuple(unbound),
                        {k: tuple(v) for k, v in copies.items()}, preempted, tuple(free))


@dataclass(frozen=True)
class PlanSnapshot:
    by_service: Mapping[str, tuple[Raw, ...]]  # ModelService name -> its ScalePlans
    held: frozenset[str]  # pods unfinished plans bind or send from (targets, host-copy sources)

    def of(self, service: str) -> tuple[Raw, ...]:
        return self.by_service.get(service, ())


def held_pods(sp: Raw) -> list[Raw]:
    """A ScalePlan's targets and its host-copy sources (idle pods it sends from): no other plan binds them."""
    spec = sp.get("spec") or {}
    return [*(spec.get("targets") or []), *(s for s in spec.get("sources") or [] if s.get("hostCopy") and s.get("pod"))]


def group_plans(plans: Sequence[Raw]) -> PlanSnapshot:
    by: dict[str, list[Raw]] = {}
    held: set[str] = set()
    for p in plans:
        by.setdefault(((p.get("spec") or {}).get("modelServiceRef") or {}).get("name", ""), []).append(p)
        if (p.get("status") or {}).get("phase") not in TERMINAL:
            held.update(t.get("pod") or t["instance"] for t in held_pods(p))
    return PlanSnapshot({k: tuple(v) for k, v in by.items()}, frozenset(held))


def cached(cache: dict[Any, tuple[tuple[int, ...], Any, tuple[Any, ...]]], key: Any, objs: Sequence[Any],
           extra: Any, build: Callable[[], Any]) -> Any:
    """`build()` once per version of `objs` (their ids, plus `extra`'s identity), else the cached result."""
    ids = (id(extra), *map(id, objs))
    hit = cache.get(key)
    if hit is not None and hit[0] == ids:
        return hit[1]
    value = build()
    cache[key] = (ids, value, (extra, *objs))  # holding the objects keeps their ids unique while cached
    return value
