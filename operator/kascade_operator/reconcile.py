"""The ModelService reconciler, PURE: (spec, observed pods, active ScalePlans, desired counts) -> actions.

Data flow: handlers observe the world (kube.py) -> `Observed` -> `reconcile()` -> `Result` (actions +
status) -> handlers apply the actions through kube.py / the engine client. Level-triggered and
idempotent: the same observation always yields the same actions, and applying them moves the
observation toward a fixed point where `reconcile()` returns no actions. While a ScalePlan of the
service is not finished, no new plan is made for that role (one writer per role at a time).

Expectations: when the warm pool is short, fallback pods are created once. Pods created for this
service and not yet usable (not scheduled, not Ready) and pods created but not yet seen by the watch
(`expected`) count against the deficit, so a pool with no free GPU gets exactly the missing pods once,
not a storm; when the scheduler reports them Unschedulable the result says `exhausted`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kascade_operator.api import ModelServiceSpec, RoleReplicas
from kascade_operator.pool import PodView, can_serve, choose_drain, choose_targets, host_copies, usable_target

TERMINAL = ("Succeeded", "Failed")
# (idle pods, how many, the leaves of the role's ready replicas) -> targets, best first (pool.choose_targets;
# decide() passes the fleet's node-class and host-copy-aware choice, fleettargets.FleetTargets.choose)
Chooser = Callable[[Sequence[PodView], int, Collection[str | None]], list[PodView]]


@dataclass(frozen=True)
class PlanView:
    name: str
    role: str
    phase: str  # "" (just created) | Pending | Transferring | Live | Succeeded | Failed
    targets: tuple[str, ...]


@dataclass(frozen=True)
class CreatePlan:
    role: str
    # bound, ready pods holding the model, then idle pods keeping it in host memory (host sources, never
    # bound by the plan); empty = load from spec.model.source (or from the target's own host copy)
    sources: tuple[str, ...]
    targets: tuple[str, ...]  # idle pool pods to bind and load
    reason: str
    # disaggregated serving: (prefill pod, decode pod) pairs whose link carries KV now; the planner prunes
    # sources whose egress carries one (BlitzScale: a new prefill instance loads from decode instances)
    kv_flows: tuple[tuple[str, str], ...] = ()
    host_copy: bool = False  # no sources: the (one) target binds from the host copy its engine kept


@dataclass(frozen=True)
class CreatePods:
    role: str
    count: int  # the slow fallback: the warm pool cannot cover the deficit


@dataclass(frozen=True)
class Drain:
    pod: str
    preempted_for: str | None = None  # drained for another service by the fleet's arbitration (fleetboard.py)


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
    short: int = 0  # replicas the warm pool could not cover this round
    coming: int = 0  # fallback pods created for this service and not usable yet (incl. `expected`)
    exhausted: bool = False  # some of them the scheduler cannot place (no free GPU)


def role_want(spec: ModelServiceSpec, role: str, bounds: RoleReplicas) -> int | None:
    """The scale subresource's (or a per-role) desired count, when one is set: while it is set it is
    the one writer of that role's count and the policy stays off for the role."""
    if bounds.desired is not None:
        return bounds.desired
    total = spec.replicas.desired
    if total is None:
        return None
    if role == "colocated":
        return total
    # disaggregated: the scale subresource sets the total; a role without its own desired count gets
    # the total minus the other role's set count, else a share proportional to the roles' max
    r = spec.replicas
    assert r.prefill is not None and r.decode is not None
    other = r.decode if role == "prefill" else r.prefill
    if other.desired is not None:
        return max(bounds.min, min(bounds.max, total - other.desired))
    share = round(total * bounds.max / (r.prefill.max + r.decode.max)) if role == "prefill" else \
        total - round(total * r.prefill.max / (r.prefill.max + r.decode.max))
    return max(bounds.min, min(bounds.max, share))


def role_bounds(spec: ModelServiceSpec) -> dict[str, RoleReplicas]:
    r = spec.replicas
    if spec.mode == "colocated":
        assert r.colocated is not None  # the spec validator guarantees it
        return {"colocated": r.colocated}
    assert r.prefill is not None and r.decode is not None
    return {"prefill": r.prefill, "decode": r.decode}


def pd_sources(pods: Sequence[PodView], name: str, role: str,
               ready: Sequence[PodView]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Sources for a scale-up of `role` and the KV flows the planner must respect. Colocated: the role's
    ready pods, no flows. Prefill or decode: every ready pod of the service (both roles hold the same
    model: a prefill instance may load from decode instances and vice versa), and every ready prefill ->
    ready decode pair as a KV flow (any decoder may receive KV from any prefiller)."""
    if role not in ("prefill", "decode"):
        return tuple(sorted(p.pod_name for p in ready)), ()
    mine = [
        p for p in pods if p.model_service == name and p.ready and not p.draining and p.role in ("prefill", "decode")
    ]
    pre = sorted(p.pod_name for p in mine if p.role == "prefill")
    dec = sorted(p.pod_name for p in mine if p.role == "decode")
    return tuple(sorted(p.pod_name for p in mine)), tuple((a, b) for a in pre for b in dec)


def held_out(idle: Sequence[PodView]) -> str:
    """The note's tail naming idle pods a ScalePlan dropped as unhealthy (recovery.py brings them back)."""
    bad = sorted((p.pod_name, p.unhealthy) for p in idle if p.unhealthy)
    if not bad:
        return ""
    named = ", ".join(f"{n} ({why})" for n, why in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return f"; {len(bad)} pool pod(s) held out as unhealthy until their engines answer: {named}"


def reconcile(name: str, spec: ModelServiceSpec, pods: Sequence[PodView], plans: Sequence[PlanView],
              desired: Mapping[str, int] | None = None, reason: str = "", unavailable: Collection[str] = (),
              expected: int = 0, release_last: Collection[str] = (), choose: Chooser = choose_targets) -> Result:
    """`name`: the service key pods carry (pool.service_key). `desired`: the policy's wish per role
    (missing role -> the role's set desired count, else its min); it is clamped to the role's min..max
    here, so a bad policy output can never break bounds. `unavailable`: idle-looking pods that other
    services' plans have already taken (their bindings may not be visible yet); never chosen as
    targets. `expected`: fallback pods created for this service that the watch has not shown yet.
    `release_last`: roles whose last ready copy may be drained (min 0 and idle: scale to zero). `choose`: which
    idle pods to bind (default: the pool's order, `pool.choose_targets`)."""
    actions: list[Action] = []
    roles: dict[str, RoleCount] = {}
    notes: list[str] = []
    active = [p for p in plans if p.phase not in TERMINAL]
    idle = [p for p in pods if p.model_service is None and p.pool and not p.draining
            and can_serve(p, spec.model.name, name, spec.engine.capacity, spec.engine.tp)]
    # created for us, not usable yet: they will be, and count against the deficit (expectations)
    pending = [p for p in idle if p.created_for == name and not usable_target(p) and not p.unhealthy]
    coming = len(pending) + max(0, expected)
    exhausted = any(p.unschedulable for p in pending)
    short_total = 0
    taken: set[str] = {t for p in active for t in p.targets} | set(unavailable)
    progressing = bool(active)
    for role, bounds in role_bounds(spec).items():
        mine = [p for p in pods if p.model_service == name and p.role == role]
        serving = [p for p in mine if not p.draining]
        ready = [p for p in serving if p.ready]
        want = (desired or {}).get(role)
        fixed = role_want(spec, role, bounds)
        if want is None:
            want = fixed if fixed is not None else bounds.min
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
            copies = host_copies(free, spec.model.name) if not ready and not serving else []
            if copies:
                # no copy on a GPU: the first replica binds from a host copy (memory, not the model source);
                # the rest chain from it next round
                t = copies[0]
                taken.add(t.pod_name)
                actions.append(CreatePlan(role, (), (t.pod_name,), (reason or f"{role}: {len(serving)} -> {want} "
                                          "replicas") + f"; first copy from the host copy on {t.pod_name}",
                                          host_copy=True))
                progressing = True
                continue
            if not ready and spec.model.source.pvc is not None:
                # the first copy of a pvc source loads where the claim is mounted: a pod created for it
                free = [p for p in free if p.created_for == name]
            targets = choose(free, need, {p.leaf for p in ready})
            taken.update(t.pod_name for t in targets)
            if targets:
                srcs, flows = pd_sources(pods, name, role, ready)
                if srcs:
                    # idle pods keeping the model in host memory send too (kind host): they serve no requests
                    # and carry no KV; they stay released and keep their copy (not targets: those lose it)
                    chosen = {t.pod_name for t in targets}
                    srcs += tuple(p.pod_name for p in host_copies(free, spec.model.name) if p.pod_name not in chosen)
                actions.append(CreatePlan(role, srcs, tuple(t.pod_name for t in targets),
                                          reason or f"{role}: {len(serving)} -> {want} replicas", flows))
                progressing = True
            if len(targets) < need:
                short = need - len(targets)
                short_total += short
                create = max(0, short - coming)
                coming = max(0, coming - short)
                if create:
                    actions.append(CreatePods(role, create))
                notes.append(f"warm pool short by {short} pod(s) for {role}"
                             + (f"; creating {create}" if create else "; waiting for the pods created for it")
                             + held_out(idle))
                progressing = True
        elif len(serving) > want:
            # never drain the last ready copy (choose_drain keeps one), unless the idle release allows it or
            # the set desired count (scale subresource, kubectl scale --replicas=0 with min 0) asks for zero
            last_may_go = role in release_last or (fixed == 0 and want == 0)
            for p in choose_drain(serving, len(serving) - want, keep_last=not last_may_go):
                actions.append(Drain(p.pod_name))
                progressing = True
    available = all(r.desired == 0 or r.ready >= 1 for r in roles.values())
    return Result(tuple(actions), roles, progressing, available, tuple(notes), short_total,
                  len(pending) + max(0, expected), exhausted)
