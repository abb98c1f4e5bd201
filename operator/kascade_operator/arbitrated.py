"""One round's share of the fleet arbitration, PURE (decide() calls it; fleetboard.py computes the arbitration).

Data flow: the round's per-role decisions (after the zero rule) + `World.fleet` (the pool's `Arbitration`, or
None while the pool covers every ask) + the service's pods -> `apply_fleet` -> `FleetRound`:
- the desired count per role, capped at the role's grant when another service ranked first or engines are
  coming to it from preempted replicas (it binds only what it may bind now: no fallback pods for the rest);
- Drain actions for its replicas the arbitration preempted (each marked for the service it goes to);
- the post it leaves on the board for the next arbitration (its ask: replicas held, and coming from
  preemptions, replicas wanted, min, priority class, SLO pressure; its replicas with load and first-bound time);
- `status.arbitration`, an `Arbitrated` condition, and `Arbitrated` / `Preempted` Events.

SLO pressure (>= 1 violating), per role: with no replica and a want, 1 + want; growing, want / held; holding
under load, 0.5 x want / held (giving one away would make it 1: a busy peer); idle, 0; and at least the
measured mean TTFT over spec.slo.ttftMs when both are known. Quantized to 0.05 and loads to 0.1, so the board
changes (and is arbitrated again) when the numbers move, not at every scrape.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kascade_operator.api import ModelServiceSpec, RoleReplicas
from kascade_operator.decide import RoleDecision, slo_of
from kascade_operator.fleetboard import Post
from kascade_operator.pool import PodView
from kascade_operator.reconcile import Drain, role_want
from kascade_operator.world import Event, RoleWorld, World
from kascade_planner.arbitration import Grant, Replica, ServiceAsk


def entry(key: str, role: str) -> str:
    """The arbitration entry of one role of a service: the service key (colocated), `key[role]` otherwise."""
    return key if role == "colocated" else f"{key}[{role}]"


def pressure(d: RoleDecision, serving: int, want: int, r: RoleWorld, spec: ModelServiceSpec) -> float:
    """The role's SLO pressure (module docstring), quantized."""
    snap = r.snap
    if serving == 0:
        p = 1.0 + want if want > 0 else 0.0
    elif want > serving:
        p = want / serving
    elif snap.in_flight > 0 or snap.output_tokens_per_s > 0:
        p = 0.5 * want / serving
    else:
        p = 0.0
    slo = slo_of(spec)
    if slo is not None and slo.ttft_s and snap.ttft_s is not None:
        p = max(p, snap.ttft_s / slo.ttft_s)
    return round(p * 20) / 20


@dataclass(frozen=True)
class FleetRound:
    desired: Mapping[str, int]
    drains: tuple[Drain, ...] = ()
    post: Post | None = None
    status: Mapping[str, Any] | None = None  # status.arbitration (None: got what it asked)
    events: tuple[Event, ...] = ()
    capped: bool = False  # a role got less than it asked or waits for preempted replicas (re-checked each interval)
    wake: tuple[str, ...] = ()  # service keys of the donors whose replicas were preempted for this service


def apply_fleet(w: World, spec: ModelServiceSpec, bounds: Mapping[str, RoleReplicas],
                decisions: Sequence[RoleDecision], desired: MutableMapping[str, int],
                pods: Sequence[PodView]) -> FleetRound:
    """Cap `desired` (a copy is returned) by the grants and drain the preempted replicas (module docstring)."""
    desired = dict(desired)
    arb = w.fleet.arbitration if w.fleet is not None else None
    grants = {g.service: g for g in arb.grants} if arb is not None else {}
    entries: list[ServiceAsk] = []
    replicas: list[Replica] = []
    drains: list[Drain] = []
    events: list[Event] = []
    shorts: list[tuple[Grant, list[str]]] = []
    wake: set[str] = set()
    waiting = False
    mine = w.fleet.mine if w.fleet is not None else None
    roles = {r.role: r for r in w.roles}
    for d in decisions:
        b, n = bounds[d.role], entry(w.key, d.role)
        serving = [p for p in pods if p.model_service == w.key and p.role == d.role and not p.draining]
        want = desired.get(d.role)
        if want is None:
            fixed = role_want(spec, d.role, b)
            want = fixed if fixed is not None else b.min
        want = max(b.min, min(b.max, want))
        promised = w.promised.get(n, 0)
        r = roles[d.role]
        entries.append(ServiceAsk(n, len(serving) + promised, want, b.min,
                                  spec.scaling.priority if spec.scaling else 0,
                                  pressure(d, len(serving), want, r, spec)))
        for p in serving:
            bound = mine.bound_at(p.pod_name) if mine is not None else None
            replicas.append(Replica(p.pod_name, n, round(r.loads.get(p.instance, 0.0), 1),
                                    w.now if bound is None else bound))
        g = grants.get(n)
        if g is None or arb is None:
            continue
        gone = [pr for pr in arb.preemptions if pr.donor == n and pr.replica in {p.pod_name for p in serving}]
        for pr in gone:
            drains.append(Drain(pr.replica, pr.taker))
            events.append(Event("Normal", "Preempted", pr.reason))
        mine_pre = [pr for pr in arb.preemptions if pr.taker == n]
        wake.update(pr.donor.split("[", 1)[0] for pr in mine_pre)
        coming = len(mine_pre) + promised
        waiting = waiting or coming > 0
        if (g.short and g.ranked_above) or coming or gone:
            # bind now only what is not coming from preempted replicas; never drain beyond the preempted
            cap = max(len(serving) - len(gone), g.granted - coming)
            if want > cap:
                desired[d.role] = cap
        if g.short or gone:
            shorts.append((g, [pr.replica for pr in gone]))
    post = Post(w.ns, w.name, tuple(entries), tuple(replicas))
    status = arbitration_status(spec, shorts)
    old = (w.body.get("status") or {}).get("arbitration") or {}
    if status is not None and status.get("reason") and (old.get("asked"), old.get("granted")) != \
            (status["asked"], status["granted"]):
        events.append(Event("Normal", "Arbitrated", str(status["reason"])))
    return FleetRound(desired, tuple(drains), post, status, tuple(events), bool(shorts) or waiting,
                      tuple(sorted(wake)))


def arbitration_status(spec: ModelServiceSpec, shorts: Sequence[tuple[Grant, list[str]]]) -> dict[str, Any] | None:
    """status.arbitration over the service's roles that got less (or gave replicas away); None: none did."""
    if not shorts:
        return None
    return {"asked": sum(g.asked for g, _ in shorts), "granted": sum(g.granted for g, _ in shorts),
            "priority": spec.scaling.priority if spec.scaling else 0,
            "rankedAbove": sorted({n for g, _ in shorts for n in g.ranked_above}),
            "preempted": sorted(p for _, gone in shorts for p in gone),
            "reason": "; ".join(g.reason for g, _ in shorts if g.reason)[:1024]}


def arbitrated_condition(status: Mapping[str, Any] | None, gen: int | None, now_iso: str) -> dict[str, Any] | None:
    """The `Arbitrated` condition while the service gets less than it asks (absent otherwise)."""
    if status is None:
        return None
    reason = "Preempted" if status.get("preempted") else "Arbitrated"
    msg = str(status.get("reason") or f"replicas preempted for other services: {', '.join(status['preempted'])}")
    return {"type": "Arbitrated", "status": "True", "reason": reason, "message": msg[:1024],
            "lastTransitionTime": now_iso, "observedGeneration": gen}
