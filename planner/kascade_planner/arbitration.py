"""Arbitration across models when the fleet cannot give every service what it asks for (issue 35 item 2).

Data flow: each service's ask (`ServiceAsk`: replicas held, replicas its autoscaler wants, its `min`, priority
class, SLO pressure, fair-share weight) + every bound replica (`Replica`: load, when it was bound) + the idle
engines the fleet has (`free`) + the time -> `arbitrate` (pure, deterministic) -> `Arbitration`: per service a
`Grant` (the count it may have, the replicas taken from it, a reason for its status and events) and the list of
`Preemption`s (which replica goes to which service, and why).

The rule, stated once:
1. Supply is the idle engines plus what shrinking services give back (`desired < current`); every service that
   shrinks or holds gets its ask.
2. Growth is handed out one replica at a time to the growing service ranked first by (priority class, higher
   first; SLO pressure per replica held, `pressure x current / held`, pressured (>= 1) first and among those the
   higher first, so a grant relieves it; fair share: replicas held after the grant over its weight, fewer first;
   name). Ties never depend on input order.
3. When supply runs out, the next replica for the first-ranked service may come from another service (a donor)
   that ranks below it (lower priority class; or the same class and not pressured while the taker is; or the
   same class, both unpressured, and the donor holding more than the taker's fair share after the move) and
   holds more than its `min` (never below it); a busy donor of the taker's class (growing, or pressured once it
   gives one) gives only to a service holding no replica, and only beyond its fair share (a move between busy
   peers costs a load and gains nothing). The lowest priority class gives first; within it the idle replica
   first, then the least loaded, then the one bound longest ago; a replica bound within `hysteresis_s` is not
   taken (no oscillation, no pod storm: at most `max_preemptions` per call), unless the taker holds no replica
   at all and the rule is a higher class or fair share (neither can move the replica back; SLO pressure can
   flip, so it waits for the hysteresis).
4. A service that gets less than it asked for says why: how many it asked, how many it got, who ranked above it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceAsk:
    """One service's ask this round. `current`: replicas bound (serving or loading); `desired`: what its autoscaler
    wants; `min`: the floor no arbitration goes below; `priority`: its priority class (higher wins); `pressure`:
    SLO pressure (observed TTFT over its objective, or queue per replica over the policy bound: >= 1 is
    violating); `weight`: its fair-share weight."""

    name: str
    current: int
    desired: int
    min: int = 0
    priority: int = 0
    pressure: float = 0.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ServiceAsk.name must be non-empty")
        for field_name in ("current", "desired", "min"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"service {self.name}: {field_name} must be >= 0, got {getattr(self, field_name)}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"service {self.name}: weight must be a finite number > 0, got {self.weight}")
        if not (self.pressure >= 0 and math.isfinite(self.pressure)):
            raise ValueError(f"service {self.name}: pressure must be a finite number >= 0, got {self.pressure}")

    @property
    def pressured(self) -> bool:
        return self.pressure >= 1.0


@dataclass(frozen=True)
class Replica:
    """A bound replica: its id, the service it serves, its load (requests in flight or busy share: 0 is idle) and
    when it was bound (seconds, the same clock as `now`)."""

    id: str
    service: str
    load: float
    bound_s: float


@dataclass(frozen=True)
class Preemption:
    replica: str
    donor: str
    taker: str
    reason: str


@dataclass(frozen=True)
class Grant:
    service: str
    asked: int  # the count its autoscaler wanted
    granted: int  # the count it may have after this round (preempted replicas already subtracted)
    preempted: tuple[str, ...]  # its replicas released for other services
    reason: str  # empty when it got what it asked for
    ranked_above: tuple[str, ...] = ()  # services granted engines while it waited (sorted)

    @property
    def short(self) -> int:
        return max(0, self.asked - self.granted)


@dataclass(frozen=True)
class Arbitration:
    grants: tuple[Grant, ...]
    preemptions: tuple[Preemption, ...]
    free_left: int  # idle engines nobody was granted

    def grant(self, service: str) -> Grant:
        for g in self.grants:
            if g.service == service:
                return g
        raise KeyError(f"no grant for service {service!r}")


@dataclass(frozen=True)
class ArbitrationConfig:
    hysteresis_s: float = 30.0  # a replica bound this recently is never preempted
    max_preemptions: int = 4  # per call: preemption is gradual, never a storm

    def __post_init__(self) -> None:
        if not (self.hysteresis_s >= 0 and math.isfinite(self.hysteresis_s)):
            raise ValueError(f"hysteresis_s must be a finite number >= 0, got {self.hysteresis_s}")
        if self.max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {self.max_preemptions}")


def _pressure(a: ServiceAsk, held: int) -> float:
    """`a`'s SLO pressure once it holds `held` replicas (its load spread over them)."""
    return a.pressure * max(a.current, 1) / max(held, 1)


def _rank(a: ServiceAsk, held: int) -> tuple[int, int, float, float, str]:
    """Sort key of the next replica for `a` (smaller first), holding `held` before it."""
    p = _pressure(a, held)
    return (-a.priority, 0 if p >= 1 else 1, -p if p >= 1 else 0.0, (held + 1) / a.weight, a.name)


def _fair(taker: ServiceAsk, taker_held: int, donor: ServiceAsk, donor_held: int) -> str | None:
    """Fair share allows the move: the donor keeps at least what the taker holds after it (weighted). The rule is
    antisymmetric, so a replica moved by it is never moved back by it."""
    if (donor_held - 1) / donor.weight >= (taker_held + 1) / taker.weight:
        return (f"fair share: {donor.name} holds {donor_held} (weight {donor.weight:g}), "
                f"{taker.name} {taker_held} (weight {taker.weight:g})")
    return None


def _outranks(taker: ServiceAsk, taker_held: int, donor: ServiceAsk, donor_held: int) -> str | None:
    """Why `taker` may take a replica from `donor` (None: it may not)."""
    if taker.priority != donor.priority:
        return f"priority {taker.priority} above {donor.priority}" if taker.priority > donor.priority else None
    tp, dp = _pressure(taker, taker_held), _pressure(donor, donor_held - 1)  # the donor after giving one
    if donor.desired > donor.current or dp >= 1:
        # a busy donor of the same class (growing, or pressured once it gives one) gives only to a service holding
        # no replica at all, and only beyond its fair share: moving replicas between busy peers (each move a
        # load) would only lose capacity
        return _fair(taker, taker_held, donor, donor_held) if taker_held == 0 else None
    if tp >= 1:
        return f"SLO pressure {tp:.2f} while {donor.name} meets its SLO ({dp:.2f})"
    return _fair(taker, taker_held, donor, donor_held)


def arbitrate(asks: Sequence[ServiceAsk], replicas: Sequence[Replica], free: int, now: float,
              cfg: ArbitrationConfig = ArbitrationConfig()) -> Arbitration:
    """Decide who gets the fleet's engines this round (the rule: module docstring)."""
    if free < 0:
        raise ValueError(f"free must be >= 0, got {free}")
    by_name: dict[str, ServiceAsk] = {}
    for a in asks:
        if a.name in by_name:
            raise ValueError(f"service {a.name!r} asks twice")
        by_name[a.name] = a
    mine: dict[str, list[Replica]] = {n: [] for n in by_name}
    for r in replicas:
        if r.service not in by_name:
            raise ValueError(f"replica {r.id}: service {r.service!r} has no ask")
        mine[r.service].append(r)
    supply = free + sum(max(0, a.current - a.desired) for a in asks)
    held = {a.name: min(a.current, a.desired) for a in asks}  # shrinking services already at their ask
    taken: dict[str, list[str]] = {n: [] for n in by_name}
    above: dict[str, set[str]] = {n: set() for n in by_name}  # who got engines while n waited
    preemptions: list[Preemption] = []
    blocked: set[str] = set()  # services that can get nothing more this round
    want = {a.name: a.desired for a in asks}  # a donor does not win its preempted replicas back this round
    while True:
        growing = [a for a in asks if held[a.name] < want[a.name] and a.name not in blocked]
        if not growing:
            break
        a = min(growing, key=lambda x: _rank(x, held[x.name]))
        if supply > 0:
            supply -= 1
        else:
            victim = _victim(a, held, by_name, mine, taken, now, cfg) if len(preemptions) < cfg.max_preemptions \
                else None
            if victim is None:
                blocked.add(a.name)
                continue
            rep, why = victim
            taken[rep.service].append(rep.id)
            held[rep.service] -= 1
            want[rep.service] -= 1
            above[rep.service].add(a.name)
            preemptions.append(Preemption(rep.id, rep.service, a.name,
                                          f"{rep.id} of {rep.service} (load {rep.load:g}) preempted for {a.name}: "
                                          f"{why}"))
        held[a.name] += 1
        for other in growing:
            if other.name != a.name:
                above[other.name].add(a.name)
    grants = []
    for a in sorted(asks, key=lambda x: x.name):
        got = held[a.name]
        reason = ""
        ranked = sorted(n for n in above[a.name] if n != a.name) if got < a.desired else []
        if got < a.desired:
            who = f"; ranked first: {', '.join(ranked)}" if ranked else ""
            lost = f"; {len(taken[a.name])} replica(s) preempted" if taken[a.name] else ""
            floor = " (at its min)" if got <= a.min else ""
            reason = (f"asked {a.desired}, granted {got}{floor}: the fleet is short "
                      f"(priority {a.priority}, SLO pressure {a.pressure:.2f}){who}{lost}")
        grants.append(Grant(a.name, a.desired, got, tuple(taken[a.name]), reason, tuple(ranked)))
    return Arbitration(tuple(grants), tuple(preemptions), supply)


def _victim(taker: ServiceAsk, held: dict[str, int], by_name: dict[str, ServiceAsk],
            mine: dict[str, list[Replica]], taken: dict[str, list[str]], now: float,
            cfg: ArbitrationConfig) -> tuple[Replica, str] | None:
    """The replica `taker` may preempt next, with why; None when no donor may give one."""
    best: tuple[tuple[int, float, float, str], Replica, str] | None = None
    for name, donor in by_name.items():
        if name == taker.name or held[name] <= donor.min or held[name] < 1:
            continue
        why = _outranks(taker, held[taker.name], donor, held[name])
        if why is None:
            continue
        # a taker holding nothing is not held back by hysteresis when the rule is fair share or a higher class: the
        # donor keeps at least one, and neither rule can move the replica back (SLO pressure can flip: it waits)
        starving = held[taker.name] == 0 and not why.startswith("SLO pressure")
        for r in mine[name]:
            if r.id in taken[name] or (now - r.bound_s < cfg.hysteresis_s and not starving):
                continue
            key = (donor.priority, r.load, r.bound_s, r.id)
            if best is None or key < best[0]:
                best = (key, r, why)
    return None if best is None else (best[1], best[2])
