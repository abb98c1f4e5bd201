"""The fleet's arbitration inside the simulator: the planner's `arbitrate`, every tick, across models.

Data flow (colocated mode, `SimConfig.arbitration`): per model the planner's `threshold` decision (as in
`autoscaler`) + its SLO pressure (requests waiting or in batches per instance over the policy's upper bound; a
model with requests waiting and no instance is pressured) + every serving replica's load and bind time + the
free GPU slots (less those reserved: a replica preempted for a model frees its GPUs for that model alone, which
counts them as held until it binds them) -> `kascade_planner.arbitration.arbitrate` -> scale-downs, preemptions
(drained, then released), and scale-ups of what each model was granted. The reason a
model got less than it asked is kept per model (`short_reasons`) and on the scale event of its grant.
Mixed into `simulator.Simulation`, whose state it reads and writes.
"""

from __future__ import annotations

from dataclasses import replace

from kascade_planner.arbitration import ArbitrationConfig, Replica, ServiceAsk, arbitrate
from kascade_planner.policies import Decision, ScaleState, threshold
from kascade_sim.result import ScaleEvent
from kascade_sim.state import SimState

ROLE = "colocated"


class Arbiter(SimState):
    short_reasons: dict[int, list[tuple[float, str]]]
    preemptions: int
    reserved: dict[int, int]  # per model: GPUs preempted for it, still draining

    def _pressure(self, m: int, current: int, d: Decision) -> float:
        pol = self._policy(ROLE)
        value = dict(d.metrics).get(pol.metric + "PerInstance")
        waiting = len(self.queue[(m, ROLE)])
        if current == 0:
            return 1.0 + waiting / pol.upper if waiting else 0.0
        if value is None:
            load = waiting + sum(i.load for i in self.group[(m, ROLE)] if i.active)
            value = load / current
        return max(0.0, value / pol.upper)

    def _arbitrated_tick(self, now: float, k: int) -> None:
        cfg = self.cfg
        asks, decisions = [], {}
        for m in range(self.models):
            g = (m, ROLE)
            st = self.states[g]
            current = self._instances_for(m, ROLE)
            d = threshold(self._metric(m, ROLE, k), ScaleState(ROLE, current, st.bounds, True, st.below_since_s),
                          self._policy(ROLE))
            decisions[m] = d
            self.states[g] = d.state
        # GPUs preempted for a model are its own: it binds them as they free (a draining replica finishes its
        # batch first), and nobody else is granted them meanwhile; a model that no longer needs them gives them up.
        # Never more reserved than the preempted replicas still draining and the free GPUs can give.
        room = sum(1 for i in self.instances if i.state == "draining" and i.preempted) + self._free_slots()
        for m in sorted(self.reserved, key=lambda m: (-self.reserved[m], m)):
            over = sum(self.reserved.values()) - room
            if over > 0:
                self.reserved[m] -= min(over, self.reserved[m])
        for m, n in sorted(self.reserved.items()):
            d = decisions[m]
            n = min(n, max(0, d.change))
            got = self._grow(now, m, min(n, self._free_slots()), d.reason + "; on GPUs preempted for it")
            self.reserved[m] = n - got
            decisions[m] = replace(d, current=d.current + got)
        for m, d in decisions.items():
            prio = cfg.priorities[m] if m < len(cfg.priorities) else 0
            promised = self.reserved.get(m, 0)
            asks.append(ServiceAsk(str(m), d.current + promised, max(d.desired, d.current + promised),
                                   min=self.states[(m, ROLE)].bounds.min, priority=prio,
                                   pressure=self._pressure(m, d.current, d)))
        replicas = [Replica(i.id, str(m), float(i.load + len(self.queue[(m, ROLE)])), i.alloc_s)
                    for m in range(self.models) for i in self.group[(m, ROLE)]
                    if i.state == "serving" and i.live_target is None]
        free = max(0, self._free_slots() - sum(self.reserved.values()))
        arb = arbitrate(asks, replicas, free, now, ArbitrationConfig(cfg.hysteresis_s))
        by_id = {i.id: i for i in self.instances}
        before = dict(self.reserved)
        for p in arb.preemptions:  # before the scale-downs, which pick among the replicas left
            v = by_id[p.replica]
            if v.state != "serving":
                continue
            v.state, v.preempted = "draining", True
            self._maybe_release(v, now)
            self.preemptions += 1
            self.reserved[int(p.taker)] = self.reserved.get(int(p.taker), 0) + 1
            self.events.append(ScaleEvent(now, "down", 1, p.reason, 0.0, ROLE, v.model))
        for m, d in decisions.items():
            if d.change < 0:
                self._scale_down(now, m, ROLE, -d.change, d.reason)
        for grant in sorted(arb.grants, key=lambda x: (-asks[int(x.service)].priority,
                                                       -asks[int(x.service)].pressure, int(x.service))):
            m = int(grant.service)
            ask = asks[m]
            if grant.reason:
                self.short_reasons.setdefault(m, []).append((now, grant.reason))
            grow = grant.granted + len(grant.preempted) - ask.current
            if grow > 0:
                promised = before.get(m, 0)
                # the free GPUs first, then those its preemptions freed at once; the rest stays reserved
                got = self._grow(now, m, min(grow + promised, self._free_slots()),
                                 decisions[m].reason + (f"; {grant.reason}" if grant.reason else ""))
                preempted_for = sum(1 for p in arb.preemptions if p.taker == str(m))
                self.reserved[m] = max(0, min(grow + promised - got, promised + preempted_for))

    def _grow(self, now: float, m: int, count: int, reason: str) -> int:
        """Scale model `m` up by up to `count`; how many instances it got."""
        if count <= 0:
            return 0
        before = sum(1 for i in self.group[(m, ROLE)] if i.active)
        self._scale_up(now, m, ROLE, count, reason)
        return sum(1 for i in self.group[(m, ROLE)] if i.active) - before
