"""The decide step of a round, PURE: `decide(world) -> Decision`. No I/O, no awaits; the same World gives
the same Decision (the one clock it reads besides `world.now` is a changed condition's lastTransitionTime).

Data flow (world.py has the types, observe.py fills the World, actuator.act carries the Decision out):
  spec refused -> the invalid status once per generation, steady
  else: per role the policy (decide.decide_roles) -> the zero rule (demand.zero_rule: from zero on the
  router's demand, to zero after the idle time) -> the fleet's arbitration when services share a short pool
  (arbitrated.apply_fleet: growth capped at the grant, preempted replicas drained) -> the reconciler
  (reconcile.reconcile: plans, fallback pods, drains, releases; its targets chosen by node class and host copy,
  fleettargets.py) -> convertible decoders
  (kascade_planner.conversion) -> host copies (hostcopykeeper's pure rules) -> unhealthy pods healed or
  checked later (recovery.work) -> serving gates -> status (a PoolShort Event when the reason is new),
  ModelServiceRole statuses, plans to prune, and whether the service is steady (next round at the resync) or
  moving (next round one interval on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kascade_operator import labels as L
from kascade_operator import recovery, serving_gate
from kascade_operator import roleobject as R
from kascade_operator.api import ModelServiceSpec
from kascade_operator.arbitrated import FleetRound, apply_fleet, arbitrated_condition
from kascade_operator.decide import RoleDecision, RoleInput, decide_roles
from kascade_operator.demand import zero_rule
from kascade_operator.fleettargets import FleetTargets
from kascade_operator.hostcopykeeper import keeper, surplus
from kascade_operator.pdscaling import conversion_input
from kascade_operator.podtemplate import checkpoint_path, refusals
from kascade_operator.pool import PodView
from kascade_operator.reconcile import (
    TERMINAL,
    Action,
    CreatePods,
    Drain,
    PlanView,
    Result,
    held_out,
    reconcile,
    role_bounds,
    role_want,
)
from kascade_operator.sourcehealth import source_blocker
from kascade_operator.status import Blocker, invalid_status, keep_transition_times, service_status
from kascade_operator.world import CopyWork, Decision, Event, RoleWorld, World
from kascade_planner.conversion import plan_conversions

Plan = Mapping[str, Any]


def owned(plans: Iterable[Plan], service: str) -> list[Plan]:
    return [p for p in plans if ((p.get("spec") or {}).get("modelServiceRef") or {}).get("name") == service]


def plan_view(sp: Plan) -> PlanView:
    spec, st = sp.get("spec") or {}, sp.get("status") or {}
    return PlanView(sp["metadata"]["name"], spec.get("role", ""), st.get("phase") or "",
                    tuple(t.get("pod") or t["instance"] for t in spec.get("targets") or []))


def zero(spec: ModelServiceSpec, w: World, r: RoleWorld, serving: int, lo: int,
         d: RoleDecision) -> tuple[RoleDecision, bool, float]:
    """Scale from zero on the router's demand (no engine exists to be scraped) and to zero after an idle time
    with min 0; otherwise the policy's decision stands. Returns the decision, whether the last copy may go,
    and the role's new last-busy time."""
    dem, snap = w.demand, r.snap
    busy = (snap.in_flight > 0 or snap.output_tokens_per_s > 0
            or (dem is not None and (dem.active or dem.requests_per_s > 0)) or r.last_busy_s is None)
    last_busy = w.now if busy or r.last_busy_s is None else r.last_busy_s
    idle = w.now - last_busy
    if dem is not None and dem.idle_s is not None:
        idle = min(idle, dem.idle_s)
    after = spec.scaling.idle_release_seconds if spec.scaling else 300.0
    want, why, release_last = zero_rule(serving, lo, d.desired, dem, idle, after, router=w.router)
    if want != d.desired or why:
        d = dataclasses.replace(d, desired=want, reason=why or d.reason)
    return d, release_last, last_busy


def copy_work(w: World, model: str, pods: Sequence[PodView]) -> CopyWork:
    """hostcopykeeper.py's rules on this round's snapshot: a record whose engine answered 0 bytes is cleared
    (and nothing else is done this round); else surplus copies drop and one serving pod may be asked."""
    lost = tuple(p.pod_name for p in pods if p.host_copy == model and not p.unhealthy and p.endpoint
                 and w.copy_checks.get(p.pod_name) == 0)
    if lost:
        return CopyWork(lost=lost)
    per = w.settings.host_copies_per_model
    nc = w.settings.node_cache
    ask = keeper(pods, model, w.key, per, nc)
    return CopyWork(drop=tuple(q.pod_name for q in surplus(pods, model, w.key, per, nc) if q.endpoint),
                    ask=ask.pod_name if ask is not None and ask.endpoint else None)


def refused(w: World) -> Decision:
    interval = w.settings.interval_seconds
    if w.invalid_reported:
        return Decision(None, interval=interval)
    msg = "; ".join(w.problems)
    return Decision(invalid_status(msg, w.generation), (Event("Warning", "InvalidSpec", msg),), interval=interval,
                    invalid_generation=w.generation or 0)


def decide(w: World) -> Decision:
    if w.spec is None:
        return refused(w)
    spec, name, key = w.spec, w.name, w.key
    interval = spec.scaling.interval_seconds if spec.scaling else 1.0
    bounds = role_bounds(spec)
    pods = list(w.pods)
    mine = owned(w.plans, name)
    plans = [plan_view(p) for p in mine]
    inputs = [RoleInput(r.role, sum(1 for p in pods if p.model_service == key and p.role == r.role
                                    and not p.draining), bounds[r.role].min, bounds[r.role].max, r.snap,
                        r.below_since_s) for r in w.roles]
    rnd = decide_roles(spec, inputs, w.trigger, sources=w.role_sources)
    conv = conversion_input(spec, key, pods, inputs)
    desired = dict(rnd.desired)
    release_last: set[str] = set()
    decisions: list[RoleDecision] = []
    clocks: dict[str, tuple[float | None, float | None]] = {}
    for d, inp, r in zip(rnd.decisions, inputs, w.roles, strict=True):
        busy = r.last_busy_s
        if role_want(spec, d.role, bounds[d.role]) is None:
            d, may_release_last, busy = zero(spec, w, r, inp.serving, inp.lo, d)
            if may_release_last:
                release_last.add(d.role)
            # the zero rule overrides the policy's wish, also back to current; a hold is a wish too in every
            # round (an update or resume round that left it out fell back to min: a spec edit, e.g. of
            # spec.scaling.priority, or an operator restart drained a loaded service to its min)
            desired[d.role] = d.desired
        clocks[d.role] = (d.state.below_since_s, busy)
        decisions.append(d)
    changes = tuple(d for d in decisions if d.desired != d.current)
    # a shared pool short of engines: each role's grant caps its growth, its preempted replicas drain
    fleet = apply_fleet(w, spec, bounds, decisions, desired, pods)
    preempt = {a.pod for a in fleet.drains}
    if fleet.desired != desired:
        desired = dict(fleet.desired)
    # pods unfinished plans hold (their binds may not be in the pod index yet), here and (a shared pool) in
    # other namespaces, and pods other rounds claimed: observe read the claims last, and act claims this
    # round's targets before its first await
    taken = w.held | w.reserved
    # which idle engines: those whose node class fits the model, on a node keeping its host copy first
    targets = FleetTargets.of(spec.model.name, spec.engine.tp, spec.engine.node_selector, w.node_labels,
                              w.settings.node_cache, pods, spec.engine.gpu_memory_gib)
    res = reconcile(key, spec, [dataclasses.replace(p, draining=True) if p.pod_name in preempt else p for p in pods],
                    plans, desired or None, "; ".join(d.reason for d in changes), taken, w.expected, release_last,
                    targets.choose)
    events: list[Event] = list(fleet.events)
    blocker: Blocker | None = None
    actions: list[Action] = list(fleet.drains)
    for a in res.actions:
        why = refusals(spec, w.settings) if isinstance(a, CreatePods) else []
        if isinstance(a, CreatePods) and why:
            msg = (f"{a.role}: warm pool short by {a.count}; not creating pods: " + "; ".join(why)
                   + held_out([p for p in pods if p.model_service is None]))
            events.append(Event("Warning", "Forbidden", msg))
            blocker = Blocker("Forbidden", msg)
        else:
            actions.append(a)
    # the pods this round drains count as draining for the host-copy keeper (their releases keep one)
    drains = {a.pod for a in res.actions if isinstance(a, Drain)} | preempt
    copies = copy_work(w, spec.model.name, [dataclasses.replace(p, draining=True) if p.pod_name in drains else p
                                            for p in pods])
    moving = {
        "actions": bool(res.actions), "changes": bool(changes), "progressing": res.progressing,
        "short": bool(res.short), "hostCopyAsked": copies.ask is not None, "noSweep": not w.swept,
        "releaseLast": bool(release_last), "draining": any(p.model_service == key and p.draining for p in pods),
        "scaleDownDelay": any(clocks[i.role][0] is not None and i.serving > i.lo for i in inputs),
        "minZero": any(b.min < 1 for b in bounds.values()), "arbitrated": fleet.capped,
    }
    # a source the engines cannot fetch (an hf:// download failed) is the cause to show first
    blocker = source_blocker(mine, name, checkpoint_path(spec)) or blocker
    status = new_status(w, spec, res, plans, changes, blocker, fleet)
    if not any(isinstance(a, CreatePods) for a in actions):  # creating pods says so itself (PoolEmpty)
        events += short_event(w, status)
    return Decision(
        status if any((w.body.get("status") or {}).get(k) != v for k, v in status.items()) else None,
        tuple(events), res, tuple(actions), blocker, tuple(decisions), changes, clocks,
        plan_conversions(conv) if conv is not None else None, copies,
        tuple((p, o) for p, o in serving_gate.pending(w.raw_pods) if p not in drains),
        tuple((p, o) for p, o in serving_gate.label_pending(w.raw_pods) if p not in drains),
        role_statuses(w, spec, str(status["selector"]), res), prune(mine, spec.scale_plan_history_limit),
        interval, tuple(k for k, v in moving.items() if v), post=fleet.post, wake=fleet.wake,
        health=recovery.work(pods, w.health_checks, w.health_retry, w.now))


def short_event(w: World, status: Mapping[str, Any]) -> list[Event]:
    """A Warning Event when the service turns short of pool pods, or the reason it is short changes (e.g. a
    failed ScalePlan's target is now held out as unhealthy): said once, while the condition says it each round."""
    def degraded(st: Mapping[str, Any]) -> tuple[str, str]:
        c: Mapping[str, Any] = next((c for c in st.get("conditions") or [] if c.get("type") == "Degraded"), {})
        return str(c.get("reason") or ""), str(c.get("message") or "")

    reason, msg = degraded(status)
    if reason != "PoolShort" or (reason, msg) == degraded(w.body.get("status") or {}):
        return []
    return [Event("Warning", "PoolShort", msg)]


def new_status(w: World, spec: ModelServiceSpec, res: Result, plans: Sequence[PlanView],
               changes: Sequence[RoleDecision], blocker: Blocker | None,
               fleet: FleetRound | None = None) -> dict[str, Any]:
    status = service_status(w.key, w.name, res, w.pods, plans, w.generation, blocker, spec.model.name)
    arb = fleet.status if fleet is not None else None
    status["arbitration"] = dict(arb) if arb is not None else None  # explicit null clears it (merge patch)
    cond = arbitrated_condition(arb, w.generation, w.now_iso)
    if cond is not None:
        status["conditions"].append(cond)
    if w.settings.router_url:
        status["url"] = w.settings.router_url.rstrip("/") + "/v1"
    if changes:
        d = changes[-1]
        status["lastDecision"] = {"time": w.now_iso, "policy": d.policy, "role": d.role, "from": d.current,
                                  "to": d.desired, "reason": d.reason[:1024],
                                  "metrics": {k: float(v) for k, v in d.metrics.items()}}
    old = w.body.get("status") or {}
    status["conditions"] = keep_transition_times(status["conditions"], old.get("conditions") or [])
    return status


def role_statuses(w: World, spec: ModelServiceSpec, selector: str,
                  res: Result) -> tuple[tuple[str, Mapping[str, Any]], ...]:
    """Each ModelServiceRole's status from this round's per-role counts, those that changed."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for oname, body in w.role_objects.items():
        o = R.RoleObject.of(body)
        c = res.roles.get(o.role)
        ready = c.ready if c is not None else 0
        refused = w.resolution.refused.get(oname)
        old = dict(body.get("status") or {})
        new = R.role_status(o, f"{selector},{L.ROLE}={o.role}", ready + (c.loading if c is not None else 0), ready,
                            refused, None if refused else R.effective(spec, o), list(old.get("conditions") or []),
                            w.now_iso)
        if R.status_differs(old, new):
            out.append((oname, new))
    return tuple(out)


def prune(plans: Sequence[Plan], limit: int) -> tuple[str, ...]:
    """Finished ScalePlans beyond `limit` (spec.scalePlanHistoryLimit), oldest first."""
    done = [p for p in plans if (p.get("status") or {}).get("phase") in TERMINAL]
    if len(done) <= limit:
        return ()
    done.sort(key=lambda p: ((p.get("status") or {}).get("completionTime") or "",
                             p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
    return tuple(str(p["metadata"]["name"]) for p in done[:len(done) - limit])
