"""The autoscaler inside the simulator: metrics per model and role, the planner's policies, and the
initial (or static) instance counts.

Data flow: every tick, per model and role, a `MetricsSnapshot` (queue length and busy share, KV
usage, or tokens/s, averaged over the window) -> the planner's `threshold` (+ `prescale_decode`), or
in disaggregated mode with `pd_policy="tokenVelocity"` the operator's P:D ratio (`pdpolicy`) ->
`Scaling._scale_up` / `_scale_down`; then, with convertible decoders, a conversion round through the
operator's conversion policy (`pdpolicy.apply_conversions`). Before the trace starts, `_initial_counts` sizes each group
from the first window (or statically from the peak / average demand). Mixed into
`simulator.Simulation`, whose state it reads and writes.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kascade_planner.policies import (
    Bounds,
    Decision,
    MeasuredVelocity,
    MetricsSnapshot,
    ScaleState,
    Threshold,
    prescale_decode,
    threshold,
)
from kascade_sim.instance import Instance
from kascade_sim.pdpolicy import apply_conversions, ratio_decisions, velocities
from kascade_sim.provisioning import capacity_rps, fit_by_ratio, fit_counts, mean_lengths, pick
from kascade_sim.state import SimState


class Autoscaler(SimState):
    def _policy(self, role: str) -> Threshold:
        return self.cfg.decode_policy if role == "decode" else self.cfg.policy

    def _convertible(self, m: int, role: str) -> int:
        """Serving decoders that may prefill this model's requests (convertible decoders): they count
        as prefill instances, so a lone request scales no prefiller up; a backlog beyond what they
        absorb still does."""
        if role != "prefill" or not self.sys.convertible or self._handed_waiting(m):
            return 0
        return self._decoder_share(m, [d for d in self.group[(m, "decode")] if d.state == "serving"])

    def _decoder_share(self, m: int, decoders: list[Instance]) -> int:
        """How many prefillers `decoders` amount to, whole ones: an idle decoder prefills at full speed (1), one
        decoding at the share its chunks get beside its decodes (`_side_rate` over a prefiller's velocity); only
        converted ones while the model has a prefiller (the others do not prefill then). With no prefiller at
        all, at least 1: the decoders serve its prompts (the router's fallback), so a lone request loads none."""
        prefillers = any(p.active for p in self.group[(m, "prefill")])
        takers = [d for d in decoders if d.convertible or not prefillers]
        if not takers:
            return 0
        velocity = velocities(self, m).prefill_effective
        share = sum(1.0 if not (d.n_running + d.incoming) else min(1.0, self._side_rate(d) / velocity)
                    for d in takers)
        return max(0 if prefillers or all(d.n_running + d.incoming for d in takers) else 1, math.floor(share + 1e-9))

    def _handed_waiting(self, m: int) -> bool:
        """The decoders would not serve the prefill queue: its head was handed back by one (it waits for a
        prefiller), or the decoders that may prefill would finish the queue later than a prefiller would (a serving
        one, or one started now: `Serving._remote_s`, `Serving._new_prefiller_s`) - the arrival rule
        (`conversion.arrival_verdict`) over the whole queue. Decoders must not count as prefill instances then, or
        the policy sees an instance where there is none and never starts the prefiller the queue waits for."""
        q = self.queue[(m, "prefill")]
        if not q:
            return False
        if q[0] in self.handed:
            return True
        serving = [d for d in self.group[(m, "decode")] if d.state == "serving"]
        if not serving:
            return False  # a decoder still loading takes it when ready (an idle decoder takes any prompt)
        fallback = not any(p.accepting for p in self.group[(m, "prefill")])
        takers = [d for d in serving if d.convertible or fallback]
        velocity = velocities(self, m).prefill_effective
        rate = sum(velocity if not (d.n_running + d.incoming) else
                   ((d.rate.rate() or 0.0) if d.convertible else self._side_rate(d)) for d in takers)
        if rate <= 0:
            return True
        local = (sum(self.inp[r] for r in q) + sum(d.chunk_left for d in takers)) / rate
        alternatives = [x for x in (self._remote_s(m, q[-1]), self._new_prefiller_s(m, q[-1])) if x is not None]
        return bool(alternatives) and local > min(alternatives)

    def _instances_for(self, m: int, role: str) -> int:
        """Instances the policy sees for a group: its active ones; for prefill with convertible
        decoders also every decoder of the model not yet released (a draining one is taken back
        when the decode floor rises for waiting prefill work)."""
        n = sum(1 for i in self.group[(m, role)] if i.active)
        if role == "prefill" and self.sys.convertible and not self._handed_waiting(m):
            n += self._decoder_share(m, [d for d in self.group[(m, "decode")] if d.state != "released"])
        return n

    def _metric(self, m: int, role: str, k: int) -> MetricsSnapshot:
        now = self._now
        pol = self.cfg.decode_policy if role == "decode" else self.cfg.policy
        if pol.metric == "tokensPerSecond":
            series = self.demand[(m, role)]
            return MetricsSnapshot(now, series[k] if k < len(series) else 0.0)
        grp = self.group[(m, role)]
        if pol.metric == "queueLength":
            # Waiting requests plus busy instances (instance-seconds busy per second since the last
            # tick): above `upper` per instance there is a backlog; below `lower`, instances idle.
            busy = self.busy_time[(m, role)] - self.busy_seen[(m, role)]
            self.busy_seen[(m, role)] = self.busy_time[(m, role)]
            capable = sum(1 for i in grp if i.accepting) + self._convertible(m, role)
            value = len(self.queue[(m, role)]) + min(busy / self.cfg.tick_s, float(capable))
        else:  # KV usage of the decoders, counting the KV of requests waiting for one
            active = [i for i in grp if i.active]
            waiting = sum(self.inp[r] + self.out[r] for r in self.queue[(m, role)])
            kv = (sum(i.kv_reserved for i in active) + waiting) / (self.kv_cap * max(1, len(active)))
            slots = (sum(i.n_running + i.incoming for i in active) + len(self.queue[(m, role)])) / (
                self.spec.max_batch * max(1, len(active)))
            value = max(kv, slots)
        hist = self.history[(m, role)]
        hist.append(value)
        mean = sum(hist) / len(hist)
        if pol.metric == "queueLength":
            if pol.queue_drain_s is None:
                return MetricsSnapshot(now, in_flight=round(mean))
            # the prompt tokens waiting and one prefiller's capacity (the engines' measured velocity)
            return MetricsSnapshot(
                now,
                in_flight=round(mean),
                queue_tokens=float(sum(self.inp[r] for r in self.queue[(m, role)])),
                measured=MeasuredVelocity(prefill_capacity_tokens_per_s=velocities(self, m).prefill_effective),
            )
        return MetricsSnapshot(now, kv_usage=mean, in_flight=len(self.queue[(m, role)]))

    def _tick(self, now: float, k: int) -> None:
        if self.sys.static is None and self.arbitrated:
            self._arbitrated_tick(now, k)  # arbiter.Arbiter: the planner's arbitration across models
        elif self.sys.static is None:
            # Models with no instance decide first: a GPU freed for them is not taken back by a model
            # that is merely growing.
            for m in sorted(range(self.models), key=lambda m: any(i.active for i in self.group[(m, self.roles[0])])):
                decisions: dict[str, Decision] = {}
                for role in reversed(self.roles):  # decode first: convertible decoders count for prefill
                    g = (m, role)
                    st = self.states[g]
                    bounds = st.bounds
                    if role == "decode" and (self.queue[g] or any(i.active for i in self.group[(m, "prefill")])
                                             or self.queue[(m, "prefill")]):
                        # Prefillers need a decoder to finish (a prompt waiting for prefill will need one
                        # too: it is loaded beside the prefiller, not after its KV waits); with convertible
                        # decoders, a decoder is also what prefills a waiting request when the model has
                        # no prefiller.
                        bounds = Bounds(max(1, bounds.min), bounds.max)
                    current = self._instances_for(m, role)
                    if role == "prefill" and "decode" in decisions:
                        current += max(0, decisions["decode"].change) if self.sys.convertible else 0
                        # the decoders counted as prefill instances shift the bounds too: the bounds are
                        # the prefillers' own (a max of 1 must not release the one prefiller because a
                        # decoder is counted next to it)
                        extra = current - sum(1 for i in self.group[g] if i.active)
                        bounds = Bounds(bounds.min + extra, bounds.max + extra)
                    st = ScaleState(role, current, bounds, True, st.below_since_s)
                    pol = self.cfg.decode_policy if role == "decode" else self.cfg.policy
                    decisions[role] = threshold(self._metric(m, role, k), st, pol)
                if "decode" in decisions and self.cfg.pd_policy == "tokenVelocity":
                    # both counts from the operator's P:D ratio policy (the threshold answers above only
                    # carried the states: current counts, bounds with the raised decode floor)
                    states = {r: decisions[r].state for r in ("prefill", "decode")}
                    states["prefill"] = replace(states["prefill"], current=sum(
                        1 for i in self.group[(m, "prefill")] if i.active))
                    decisions = ratio_decisions(self, m, k, now, states)
                elif "decode" in decisions and self.cfg.decoders_per_prefiller > 0:
                    decisions["decode"] = prescale_decode(decisions["prefill"], decisions["decode"],
                                                          self.cfg.decoders_per_prefiller)
                for role in reversed(self.roles):  # decode first: prefilled KV needs somewhere to go
                    d = decisions[role]
                    keep = self.states[(m, role)].bounds  # the raised decode floor holds for this tick only
                    self.states[(m, role)] = d.state if d.state.bounds is keep else replace(d.state, bounds=keep)
                    if d.change > 0:
                        self._scale_up(now, m, role, d.change, d.reason)
                    elif d.change < 0:
                        self._scale_down(now, m, role, -d.change, d.reason)
                if self.sys.convertible and "decode" in decisions:
                    apply_conversions(self, m, k, now)
        gpus = self.gpus_allocated
        copies = self._host_copies(now)
        self.cache_peak = max(self.cache_peak, copies)
        self.samples.append((now, gpus, copies, float(sum(len(q) for q in self.queue.values()))))

    def _initial_counts(self) -> dict[tuple[int, str], int]:
        cfg = self.cfg
        how = self.sys.static or "first"
        first_full = max(0, math.ceil(cfg.window_s / cfg.tick_s) - 1)
        wanted = {}
        needs: dict[tuple[int, str], float] = {}
        for (m, role) in self.group:
            pol = cfg.decode_policy if role == "decode" else cfg.policy
            if pol.metric == "tokensPerSecond":
                need = pick(self.demand[(m, role)], how, first_full) / pol.upper
            else:
                cap = capacity_rps(self.spec, self.kv_cap, role, *mean_lengths(self.wl, m)) * cfg.target_utilization
                need = pick(self.rps[m], how, first_full) / cap
            needs[(m, role)] = need
            wanted[(m, role)] = max(cfg.min_instances, min(self.max_instances, math.ceil(need - 1e-9)))
        slots = self.hw.hosts * (self.hw.gpus_per_host // self.spec.tp)
        if self.sys.static:
            # A static system never scales: every model and role keeps at least one instance, and the cluster is
            # split by the demand/capacity ratio (`fit_by_ratio`). Clamping each role to the cluster's size and then
            # shrinking in proportion made the split 1:1 whatever the capacities (4P + 4D where 7P + 1D fits).
            counts = fit_by_ratio(needs, 1, slots, self.max_instances)
        else:
            counts = fit_counts(wanted, cfg.min_instances, slots)
        for m in range(self.models):  # a prefiller without a decoder would hold KV nobody takes
            if counts.get((m, "prefill"), 0) and not counts.get((m, "decode"), 0):
                counts[(m, "prefill")] -= 1
                counts[(m, "decode")] = 1
        return counts

