"""The fleet's arbitration inside the simulator: the planner's `arbitrate`, every tick, across models.

Data flow (colocated mode, `SimConfig.arbitration`): per model the planner's `threshold` decision (as in
`autoscaler`) + its SLO pressure (requests waiting or in batches per instance over the policy's upper bound; a
model with requests waiting and no instance is pressured) + every serving replica's load and bind time + the
free GPU slots (and those a preempted replica still draining will free) -> `kascade_planner.arbitration.arbitrate`
-> scale-downs, preemptions (drained, then released), and scale-ups of what each model was granted. The reason a
model got less than it asked is kept per model (`short_reasons`) and on the scale event of its grant.
Mixed into `simulator.Simulation`, whose state it reads and writes.
"""

from __future__ import annotations

from kascade_planner.arbitration import ArbitrationConfig, Replica, ServiceAsk, arbitrate
from kascade_planner.policies import Decision, ScaleState, threshold
from kascade_sim.result import ScaleEvent
from kascade_sim.state import SimState

ROLE = "colocated"


class Arbiter(SimState):
    short_reasons: dict[int, list[tuple[float, str]]]
    preemptions: int

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
            prio = cfg.priorities[m] if m < len(cfg.priorities) else 0
            asks.append(ServiceAsk(str(m), d.current, d.desired, min=st.bounds.min, priority=prio,
                                   pressure=self._pressure(m, current, d)))
        replicas = [Replica(i.id, str(m), float(i.load + len(self.queue[(m, ROLE)])), i.alloc_s)
                    for m in range(self.models) for i in self.group[(m, ROLE)]
                    if i.state == "serving" and i.live_target is None]
        # GPUs a preempted replica still draining will free count as supply: the next tick does not preempt again
        pending = sum(1 for i in self.instances if i.state == "draining" and i.preempted)
        arb = arbitrate(asks, replicas, self._free_slots() + pending, now, ArbitrationConfig(cfg.hysteresis_s))
        by_id = {i.id: i for i in self.instances}
        for m, d in decisions.items():
            self.states[(m, ROLE)] = d.state
            if d.change < 0:
                self._scale_down(now, m, ROLE, -d.change, d.reason)
        for p in arb.preemptions:
            v = by_id[p.replica]
            v.state, v.preempted = "draining", True
            self._maybe_release(v, now)
            self.preemptions += 1
            self.events.append(ScaleEvent(now, "down", 1, p.reason, 0.0, ROLE, v.model))
        for grant in sorted(arb.grants, key=lambda x: (-asks[int(x.service)].priority,
                                                       -asks[int(x.service)].pressure, int(x.service))):
            m = int(grant.service)
            d = decisions[m]
            grow = grant.granted + len(grant.preempted) - d.current
            if grant.reason:
                self.short_reasons.setdefault(m, []).append((now, grant.reason))
            if grow > 0:
                self._scale_up(now, m, ROLE, grow, d.reason + (f"; {grant.reason}" if grant.reason else ""))
