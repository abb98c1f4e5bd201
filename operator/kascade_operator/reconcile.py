"""The ModelService reconciler, PURE: (spec, observed pods, active ScalePlans, desired counts) -> actions.

Data flow: handlers observe the world (kube.py) -> `Observed` -> `reconcile()` -> `Result` (actions +
status) -> handlers apply the actions through kube.py / the engine client. Level-triggered and
idempotent: the same observation always yields the same actions, and applying them moves the
observation toward a fixed point where `reconcile()` returns no actions. While a ScalePlan of the
service is not finished, no new plan is made for that role (one writer per role at a time).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kascade_operator.api import ModelServiceSpec, RoleReplicas
from kascade_operator.pool import PodView, choose_drain, choose_targets

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PlanView:
    name: str
    role: str
    phase: str  # "" (just created) | Pending | Transferring | Live | Succeeded | Failed
    targets: tuple[str, ...]


@dataclass(frozen=True)
class CreatePlan:
    role: str
    sources: tuple[str, ...]  # bound, ready pods holding the model; empty = load from spec.model.source
    targets: tuple[str, ...]  # idle pool pods to bind and load
    reason: str


@dataclass(frozen=True)
class CreatePods:
    role: str
    count: int  # the slow fallback: the warm pool cannot cover the deficit


@dataclass(frozen=True)
class Drain:
    pod: str


@dataclass(frozen=True)
class Release:
    pod: str  # drained: unbind and return to the pool


Action = CreatePlan | CreatePods | Drain | Release


@dataclass(frozen=True)
class RoleCount:
    desired: int
    ready: int
    loading: int


@dataclass(frozen=True)
class Result:
    actions: tuple[Action, ...]
    roles: Mapping[str, RoleCount]
    progressing: bool
    available: bool
    notes: tuple[str, ...] = field(default=())


def role_bounds(spec: ModelServiceSpec) -> dict[str, RoleReplicas]:
    r = spec.replicas
    if spec.mode == "colocated":
        assert r.colocated is not None  # the spec validator guarantees it
        return {"colocated": r.colocated}
    assert r.prefill is not None and r.decode is not None
    return {"prefill": r.prefill, "decode": r.decode}


def reconcile(name: str, spec: ModelServiceSpec, pods: Sequence[PodView], plans: Sequence[PlanView],
              desired: Mapping[str, int] | None = None, reason: str = "", unavailable: Collection[str] = (),
              release_last: Collection[str] = ()) -> Result:
    """`desired`: the policy's wish per role (missing role -> spec min, or replicas.desired in colocated
    mode); it is clamped to the role's min..max here, so a bad policy output can never break bounds.
    `unavailable`: idle-looking pods that other services' plans have already taken (their bindings may
    not be visible yet); never chosen as targets. `release_last`: roles whose last ready copy may be drained
    (min 0 and idle: scale to zero)."""
    actions: list[Action] = []
    roles: dict[str, RoleCount] = {}
    notes: list[str] = []
    active = [p for p in plans if p.phase not in TERMINAL]
    idle = [p for p in pods if p.model_service is None and p.pool and not p.draining]
    taken: set[str] = {t for p in active for t in p.targets} | set(unavailable)
    progressing = bool(active)
    for role, bounds in role_bounds(spec).items():
        mine = [p for p in pods if p.model_service == name and p.role == role]
        serving = [p for p in mine if not p.draining]
        ready = [p for p in serving if p.ready]
        want = (desired or {}).get(role)
        if want is None:
            want = spec.replicas.desired if (role == "colocated" and spec.replicas.desired is not None) else bounds.min
        want = max(bounds.min, min(bounds.max, want))
        roles[role] = RoleCount(want, len(ready), len(serving) - len(ready))
        for p in mine:
            if p.draining and p.drained:
                actions.append(Release(p.pod_name))
        if any(p.role == role for p in active):
            continue  # a plan of this role is running: let it finish before deciding again
        if len(serving) < want:
            need = want - len(serving)
            free = [p for p in idle if p.pod_name not in taken]
            targets = choose_targets(free, need, {p.leaf for p in ready})
            taken.update(t.pod_name for t in targets)
            if targets:
                actions.append(CreatePlan(role, tuple(sorted(p.pod_name for p in ready)),
                                          tuple(t.pod_name for t in targets),
                                          reason or f"{role}: {len(serving)} -> {want} replicas"))
                progressing = True
            if len(targets) < need:
                actions.append(CreatePods(role, need - len(targets)))
                notes.append(f"warm pool short by {need - len(targets)} pod(s) for {role}")
                progressing = True
        elif len(serving) > want:
            # never drain the last ready copy: choose_drain keeps at least one ready pod
            for p in choose_drain(serving, len(serving) - want, keep_last=role not in release_last):
                actions.append(Drain(p.pod_name))
                progressing = True
    available = all(r.desired == 0 or r.ready >= 1 for r in roles.values())
    return Result(tuple(actions), roles, progressing, available, tuple(notes))
