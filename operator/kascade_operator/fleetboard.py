"""The fleet board: what every service sharing one warm pool asks for, and the arbitration over it (issue 35).

Concept: services sharing a pool compete for its idle engines. Each round leaves its ask on its pool's board
(`Post`: per role an arbitration entry, `kascade_planner.arbitration.ServiceAsk`, and its bound replicas with
load and the time the operator first saw them bound). When the posted growth exceeds the idle engines, the
planner's pure `arbitrate` decides who gets what, over every post; the rounds read the result.

Data flow: act() of each round -> `FleetBoard.post` (a version counter and the posted growth move only when a
post changes: loads and pressure are quantized) -> the next round's observe -> `FleetBoard.view(key, free,
now)`: the `Arbitration`, computed once per (version, idle engines) and at most every `RECOMPUTE_S` (the
hysteresis clock moves) and only when the pool is short, else None -> `World.fleet` -> decide
(arbitrated.py, pure) caps growth at the grant and drains the replicas it names.

Cost per round: O(1) while the pool covers every ask (the posted growth is a running sum); when short, one
arbitration per change of the posts (O(services + replicas)), shared by every round that reads it.
Why a board of last asks and not one arbitration of fresh asks: a round knows only its own service's fresh
decision; the others' are their last rounds' (one interval old at most), which is what a level-triggered
round converges on anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kascade_planner.arbitration import Arbitration, ArbitrationConfig, Replica, ServiceAsk, arbitrate

log = logging.getLogger(__name__)

RECOMPUTE_S = 1.0  # an unchanged board is arbitrated again after this long (replicas leave their hysteresis)


@dataclass(frozen=True)
class Post:
    """One service's ask, left by its last round: its arbitration entries (one per role) and their replicas."""

    ns: str
    name: str
    entries: tuple[ServiceAsk, ...]
    replicas: tuple[Replica, ...]

    @property
    def growth(self) -> int:
        return sum(max(0, e.desired - e.current) for e in self.entries)

    def bound_at(self, pod: str) -> float | None:
        """When this service's posts first showed `pod` bound to it (the hysteresis clock)."""
        return next((r.bound_s for r in self.replicas if r.id == pod), None)


@dataclass(frozen=True)
class FleetView:
    """What a round reads of the board (World.fleet)."""

    arbitration: Arbitration | None = None  # None: the pool covers every ask (or fewer than two services)
    mine: Post | None = None  # this service's last post (its replicas' bind times)
    free: int = 0  # idle engines the arbitration counted

    def entry_names(self) -> set[str]:
        return {g.service for g in self.arbitration.grants} if self.arbitration is not None else set()


@dataclass
class FleetBoard:
    """The posts of one pool namespace (Runtime.fleet), and the arbitration cached on their version."""

    posts: dict[str, Post] = field(default_factory=dict)  # service key -> its last post
    version: int = 0
    growth: int = 0  # sum of the posts' growth (kept as posts change: the O(1) shortage check)
    _cache: tuple[tuple[int, int], float, Arbitration] | None = None

    def post(self, key: str, p: Post) -> bool:
        """Record `key`'s ask; True when it asks for more growth than before (the board changed either way)."""
        old = self.posts.get(key)
        if old == p:
            return False
        grew = p.growth > (old.growth if old is not None else 0)
        self.growth += p.growth - (old.growth if old is not None else 0)
        self.posts[key] = p
        self.version += 1
        return grew

    def remove(self, key: str) -> None:
        old = self.posts.pop(key, None)
        if old is not None:
            self.growth -= old.growth
            self.version += 1

    def short(self, free: int) -> bool:
        """The pool cannot give every posted ask its growth (and two services or more share it)."""
        return len(self.posts) >= 2 and self.growth > free

    def view(self, key: str, free: int, now: float, cfg: ArbitrationConfig) -> FleetView:
        mine = self.posts.get(key)
        if not self.short(free):
            return FleetView(None, mine, free)
        ck = (self.version, free)
        if self._cache is not None and self._cache[0] == ck and now - self._cache[1] < RECOMPUTE_S:
            return FleetView(self._cache[2], mine, free)
        asks = [e for p in self.posts.values() for e in p.entries]
        reps = [r for p in self.posts.values() for r in p.replicas]
        try:
            arb = arbitrate(asks, reps, free, now, cfg)
        except ValueError as e:  # a post out of step with another (a pod moved between them): next round
            log.warning("fleet arbitration skipped: %s", e)
            return FleetView(None, mine, free)
        last, self._cache = self._cache, (ck, now, arb)
        if last is None or (last[2].grants, last[2].preemptions) != (arb.grants, arb.preemptions):
            log.info("fleet arbitration (%d services, %d idle engines): %s%s", len(self.posts), free,
                     "; ".join(f"{g.service} {g.granted}/{g.asked}" for g in arb.grants),
                     "".join(f"; {p.reason}" for p in arb.preemptions))
        return FleetView(arb, mine, free)

    def donors(self, taker: str) -> list[str]:
        """Service keys other than `taker` holding more than their min in some role (they may give)."""
        return [k for k, p in self.posts.items() if k != taker and any(e.current > e.min for e in p.entries)]
