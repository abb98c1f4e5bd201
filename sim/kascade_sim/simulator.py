"""The discrete-event core: a workload replayed on a cluster under one system configuration.

Data flow: `Workload` (one or several models) + `Hardware` + `ModelSpec` + `System` + `SimConfig` ->
events on one heap (iteration ends, instances able to serve, KV arrivals, policy ticks; arrivals
merged from the sorted trace) -> per-request first/last token times -> `result.Result`.
Requests wait in one global queue per model and role (BlitzScale's request redirection: backlog
goes to whichever instance can take it, new and live ones included). Scale decisions come from the
planner's own policies (`threshold` on queue length or tokens/s, on KV usage for decode, with
`prescale_decode`); scale-ups call the planner's `make_plan` (chain / binomial / local) and its cost
model for every block's arrival at every target, and its `pair_live` one-to-one live pairs, sized
by its ZigZag schedule. A target may serve from its first layer (live), when the receivers jointly
hold the model (λScale pipeline) or from its last block (stop-the-world). Several models share the
GPUs and, for ServerlessLLM, each host's DRAM (`hostmem`). Deterministic: no wall clock; ties are
broken by a sequence number.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

from kascade_planner.builder import make_plan
from kascade_planner.cost import predict
from kascade_planner.plan import Instance as PlanInstance
from kascade_planner.policies import (
    Bounds,
    MetricsSnapshot,
    ScaleState,
    Threshold,
    prescale_decode,
    threshold,
)
from kascade_planner.zigzag import PairSetting, ilp_free
from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.hostmem import HostMemory
from kascade_sim.instance import Instance
from kascade_sim.provisioning import capacity_rps, demand_series, fit_counts, mean_lengths, pick
from kascade_sim.result import Result, ScaleEvent
from kascade_sim.systems import System
from kascade_sim.workload import Workload

log = logging.getLogger(__name__)

ITER, ACCEPT, READY, TICK, KV = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class SimConfig:
    # Prefill (or colocated) instances: BlitzScale's policy scales on the queue (requests waiting, plus
    # the busy fraction of each instance, per instance: scale up on a backlog, down when instances idle);
    # `metric="tokensPerSecond"` scales on the token rate instead.
    policy: Threshold = field(default_factory=lambda: Threshold(4.0, 0.3, 5.0, "queueLength"))
    # Decode instances scale on KV usage (the larger of the KV and batch-slot fractions).
    decode_policy: Threshold = field(default_factory=lambda: Threshold(0.8, 0.3, 5.0, "kvCacheUsage"))
    decoders_per_prefiller: float = 0.5  # BlitzScale §5: decode pre-scaled with prefill, whole decoders (0: off)
    tick_s: float = 0.5  # policy evaluation period
    window_s: float = 2.0  # metrics averaged over this window
    min_instances: int = 1  # per model and role
    max_instances: int | None = None  # per model and role; default: every GPU
    target_utilization: float = 0.7  # initial and static sizing: load per instance / its capacity
    seed: int = 0
    ttft_slo_s: float = 1.0
    tbt_slo_s: float = 0.1
    # "disaggregated": prefill and decode instances scale separately; KV moves prefill -> decode over
    # the scale-out network after each prefill, once a decoder has room for it.
    mode: str = "colocated"

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode must be colocated or disaggregated, got {self.mode!r}")
        if not (0 < self.tick_s <= 60) or not (0 < self.window_s <= 3600):
            raise ValueError(f"need 0 < tick_s <= 60 and 0 < window_s <= 3600, got {self.tick_s}, {self.window_s}")
        if self.min_instances < 0 or (self.max_instances is not None and self.max_instances < max(1, self.min_instances)):
            raise ValueError(f"need 0 <= min_instances <= max_instances and max >= 1, got {self.min_instances}, "
                             f"{self.max_instances}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.decoders_per_prefiller <= 16:
            raise ValueError(f"decoders_per_prefiller must be in [0, 16], got {self.decoders_per_prefiller}")
        if self.decode_policy.metric == "queueLength":
            raise ValueError("decode_policy: decode instances have no prefill queue (use kvCacheUsage or tokensPerSecond)")


class Simulation:
    def __init__(self, wl: Workload, hw: Hardware, spec: ModelSpec, sys: System, cfg: SimConfig = SimConfig(),
                 progress: Callable[[float], None] | None = None) -> None:
        if not wl.requests:
            raise ValueError(f"workload {wl.name!r} has no requests")
        self.wl, self.hw, self.spec, self.sys, self.cfg = wl, hw, spec, sys, cfg
        self.progress = progress
        self.topo = hw.topology()
        self.layout = spec.layout()
        self.kv_cap = spec.kv_capacity_tokens(hw)
        self.models = wl.models
        # A request longer than the context (or than one instance's KV) is clipped, as an engine would
        # refuse it: the prompt keeps room for one output token.
        ctx = min(spec.max_context, self.kv_cap)
        self.arr = [r.arrival_s for r in wl.requests]
        self.inp = [min(r.input_tokens, ctx - 1) for r in wl.requests]
        self.out = [min(r.output_tokens, ctx - i) for r, i in zip(wl.requests, self.inp, strict=True)]
        self.mdl = [r.model for r in wl.requests]
        self.clipped = sum(1 for r, i, o in zip(wl.requests, self.inp, self.out, strict=True)
                           if (i, o) != (r.input_tokens, r.output_tokens))
        n = len(self.arr)
        self.first = [math.nan] * n
        self.unfinished = n
        self.served_by: list[str] = [""] * n  # the instance that ran each request's prefill
        self.pairings: list[tuple[float, str, str, float]] = []  # (time, partner, live target, target ready)
        self.max_debt_s = 0.0  # the most work any partner ever owed its live target
        self.last = [math.nan] * n
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.free = {node.name: node.gpus for node in self.topo.nodes}
        self.instances: list[Instance] = []
        self.gpus_allocated = 0
        self.next_id = 0
        self.events: list[ScaleEvent] = []
        self.samples: list[tuple[float, int, int, float]] = []  # (t, gpus, host-cached copies, in flight)
        self.roles = ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode")
        groups = [(m, role) for m in range(self.models) for role in self.roles]
        self.queue: dict[tuple[int, str], deque[int]] = {g: deque() for g in groups}
        self.group: dict[tuple[int, str], list[Instance]] = {g: [] for g in groups}
        self.max_instances = min(cfg.max_instances or hw.total_gpus // spec.tp, hw.total_gpus // spec.tp)
        if self.max_instances < 1:
            raise ValueError(f"model {spec.name} needs {spec.tp} GPUs per instance; the cluster has {hw.total_gpus}")
        bounds = Bounds(min(cfg.min_instances, self.max_instances), self.max_instances)
        self.states = {g: ScaleState(g[1], 0, bounds, host_cached=True) for g in groups}
        # Metrics are averaged over the window, but never over longer than the role's scale-down
        # delay (at least one tick): an idle instance would otherwise wait for the window to forget
        # its last batch before the delay even starts (window + delay: 2.5 s for a 0.5 s delay).
        self.history: dict[tuple[int, str], deque[float]] = {
            g: deque(maxlen=max(1, round(min(cfg.window_s, max(cfg.tick_s, self._policy(g[1]).scale_down_delay_s))
                                         / cfg.tick_s)))
            for g in groups}
        self.busy_time = dict.fromkeys(groups, 0.0)  # instance-seconds of iterations started, per group
        self.busy_seen = dict.fromkeys(groups, 0.0)
        self.holder: dict[int, Instance] = {}  # request -> prefill instance holding its KV until a decoder takes it
        self.kv_bytes_per_s = hw.rdma_gbps * spec.tp * 1e9 / 8
        self._zigzag: dict[tuple[float, int], float] = {}
        self.hostmem = HostMemory([n.name for n in self.topo.nodes], hw.host_mem_gb * 1e9, spec.bytes, sys.keep_alive_s)
        self.cache_peak = 0
        self.loads = 0
        self._now = 0.0

    def _policy(self, role: str) -> Threshold:
        return self.cfg.decode_policy if role == "decode" else self.cfg.policy

    # ---- event plumbing
    def push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    # ---- placement and data path
    def _pick_node(self, m: int) -> str | None:
        tp = self.spec.tp
        cands = [n for n, f in self.free.items() if f >= tp]
        if not cands:
            return None
        if self.sys.host_cache == "ttl":  # ServerlessLLM is locality-aware: prefer hosts with a warm copy
            now = self._now
            return min(cands, key=lambda n: (not self.hostmem.warm(n, m, now), -self.free[n], n))
        return min(cands, key=lambda n: (-self.free[n], n))

    def _pool_node(self, m: int) -> str:
        return self.topo.nodes[m % len(self.topo.nodes)].name

    def _host_copies(self, now: float) -> int:
        if self.sys.host_cache == "all":
            return len(self.topo.nodes) * self.models
        if self.sys.host_cache == "one":
            return self.models
        if self.sys.host_cache == "ttl":
            return self.hostmem.count(now)
        return 0

    def _new_instance(self, node: str, m: int, role: str, now: float, state: str = "loading") -> Instance:
        self.free[node] -= self.spec.tp
        self.gpus_allocated += self.spec.tp
        inst = Instance(f"i{self.next_id}", node, self.spec.tp, now, self.kv_cap, m, role, state)
        self.next_id += 1
        self.instances.append(inst)
        self.group[(m, role)].append(inst)
        return inst

    def _preempt_idle(self, now: float, m: int, role: str) -> bool:
        """A group with no instance at all needs a GPU and none is free: release the idle instance
        (no batch, no KV) of another group that has been up longest; False when there is none."""
        floor = self.states[(m, role)].bounds.min
        idle = [i for (gm, gr), grp in self.group.items() if (gm, gr) != (m, role)
                and sum(1 for j in grp if j.active) > max(floor, 0)
                for i in grp if i.state == "serving" and not i.busy and not i.n_running and not i.kv_reserved
                and not i.incoming and i.live_target is None and (gr != "decode" or not self.queue[(gm, gr)])]
        if not idle:
            # Nothing idle: drain the least loaded prefiller of a group that has several (it finishes
            # its batch, then frees its GPUs), so a model is not starved while others keep growing.
            # One at a time: a prefiller already draining will free GPUs soon.
            if any(i.state == "draining" for (_, gr), grp in self.group.items() if gr != "decode" for i in grp):
                return False
            spare = [i for (gm, gr), grp in self.group.items() if (gm, gr) != (m, role) and gr != "decode"
                     and sum(1 for j in grp if j.active) > max(floor, 1)
                     for i in grp if i.state == "serving" and i.live_target is None]
            if spare:
                v = min(spare, key=lambda i: (i.load, i.alloc_s, i.id))
                v.state, v.preempted = "draining", True
                self._maybe_release(v, now)
                self.events.append(ScaleEvent(now, "down", 1, f"preempted (draining): model {m} {role} has no "
                                              "instance and no free GPU", 0.0, v.role, v.model))
            return False
        v = min(idle, key=lambda i: (i.alloc_s, i.id))
        v.state = "draining"
        self._maybe_release(v, now)
        self.events.append(ScaleEvent(now, "down", 1, f"preempted: model {m} {role} has no instance and no free GPU",
                                      0.0, v.role, v.model))
        return True

    def _scale_up(self, now: float, m: int, role: str, count: int, reason: str) -> None:
        # Instances still draining are loaded already: take them back first.
        for d in [i for i in self.group[(m, role)] if i.state == "draining" and not i.preempted][:count]:
            d.state = "serving"
            count -= 1
            self._kick(d, now)
        targets: list[Instance] = []
        for _ in range(count):
            node = self._pick_node(m)
            if node is None and not any(i.active for i in self.group[(m, role)]) and self._preempt_idle(now, m, role):
                node = self._pick_node(m)
            if node is None:
                break
            targets.append(self._new_instance(node, m, role, now))
        if not targets:
            return
        ptargets = [PlanInstance(t.id, t.node, t.gpus) for t in targets]
        serving = [i for g in self.roles for i in self.group[(m, g)] if i.state == "serving"]
        self.loads += len(targets)
        pairs: dict[str, Instance] = {}
        if self.sys.transfer == "local":
            if self.sys.host_cache == "ttl":
                cached = [t.node for t in targets if self.hostmem.lookup(t.node, m, now)]
            else:
                cached = [n.name for n in self.topo.nodes]
            plan = make_plan(self.topo, self.layout, (), ptargets, "local", host_cached_nodes=cached, predict=False)
            for t in targets:
                t.from_ssd = t.node not in cached
                if not t.from_ssd and self.sys.host_cache == "ttl":
                    self.hostmem.in_use(t.node, m, now)
        else:
            sources = [PlanInstance(i.id, i.node, i.gpus) for i in serving]
            if self.sys.host_cache == "one" or not sources:
                sources.append(PlanInstance(f"host:pool:{m}", self._pool_node(m), self.spec.tp, "host"))
            # KV flows prefill -> decode must not share links with weight transfers (source pruning).
            kv = [(p.id, d.id) for p in serving if p.role == "prefill" for d in serving if d.role == "decode"]
            live = self.sys.serving == "live"
            # Any serving instance of the model without a live target may partner (it holds every
            # layer); the overloaded ones of the scaled role first.
            free_partners = [i for i in serving if i.live_target is None]
            hot = sorted((i for i in free_partners if i.role == role), key=lambda i: (-i.load, i.id))
            plan = make_plan(self.topo, self.layout, sources, ptargets, self.sys.transfer, kv_flows=kv,
                             overloaded=[i.id for i in hot], predict=False, live=True if live else None)
            if live:
                by_id = {i.id: i for i in free_partners}
                pairs = {t: by_id[s] for s, t in plan.live_pairs if s in by_id}  # one to one
        arrival = dict(predict(plan, self.topo).arrival)
        joint = max(min(dict(arrival[t.id])[b] for t in targets) for b in self.layout.block_ids)
        for t in targets:
            t.solo = len(targets) == 1 or self.sys.transfer == "local"
            blocks = dict(arrival[t.id])
            t.block_times = sorted(now + s for s in blocks.values())
            t.ready_s = t.block_times[-1]
            partner = pairs.get(t.id)
            if partner is not None:
                t.accept_from_s = now + max(blocks["layer.0"], blocks["embed"])
                t.partner, partner.live_target = partner, t
                self.pairings.append((now, partner.id, t.id, t.ready_s))
                t.live_share = self._live_share(partner, t.ready_s - now)
            elif self.sys.serving == "pipeline" and len(targets) > 1:
                t.accept_from_s = now + joint
                t.slow = 1.0 + self.sys.pipeline_overhead
            else:
                t.accept_from_s = t.ready_s
            t.accept_from_s = min(t.accept_from_s, t.ready_s)
            self.push(t.accept_from_s, ACCEPT, t)
            self.push(t.ready_s, READY, t)
        self.cache_peak = max(self.cache_peak, self._host_copies(now))
        makespan = max(t.ready_s for t in targets) - now
        self.events.append(ScaleEvent(now, "up", len(targets), reason, round(makespan, 6), role, m))

    def _live_share(self, partner: Instance, load_s: float) -> float:
        """Share of the layer work a loading target takes over from its partner, from the planner's
        ILP-free ZigZag schedule of the partner's queue (load time per layer in layer computations)."""
        c = self.spec.cost
        batch_s = c.decode_s(max(1, partner.n_running), partner.kv_running)
        q = self.queue[(partner.model, partner.role)]
        if q and partner.role != "decode":
            batch_s = max(batch_s, c.prefill_s(min(self.spec.max_prefill_tokens, sum(self.inp[r] for r in list(q)[:16]))))
        # The schedule's share depends on the load time per layer in layer computations, not on the
        # layer count: solved on at most 16 layers and 6 batches, log-bucketed so a run reuses a
        # handful of schedules (each costs milliseconds).
        layers = min(16, self.spec.layers)
        ratio = load_s / batch_s
        waiting = len(q) + partner.load
        key = (round(math.log2(max(ratio, 1e-3)) * 2) / 2, max(1, min(6, waiting)))
        if key not in self._zigzag:
            sched = ilp_free(PairSetting(layers, 2 ** key[0], key[1]))
            self._zigzag[key] = sum(sched.target_layers) / (key[1] * layers)
        return self._zigzag[key]

    def _scale_down(self, now: float, m: int, role: str, count: int, reason: str) -> None:
        # The policy counts loading instances, so it may release them too: an idle one still loading
        # has its load cancelled (only when no other target's blocks pass through it). Otherwise a
        # scale-down decided while the only candidate loads would be dropped, its delay restarted,
        # and an idle instance kept until its load ends plus another delay. Loading ones go first
        # (they are furthest from useful), then the least loaded.
        cands = sorted((i for i in self.group[(m, role)]
                        if (i.state == "serving" and i.live_target is None) or i.cancellable),
                       key=lambda i: (i.load, i.state == "serving", -i.alloc_s, i.id))
        victims = cands[:count]
        for v in victims:
            v.state = "draining"
            self._maybe_release(v, now)
        if victims:
            self.events.append(ScaleEvent(now, "down", len(victims), reason, 0.0, role, m))

    def _maybe_release(self, inst: Instance, now: float) -> None:
        if inst.state != "draining" or inst.busy or inst.n_running or inst.kv_reserved or inst.debt_s:
            return
        inst.state = "released"
        inst.released_s = now
        if inst.partner is not None:  # a cancelled live target frees its partner for another pair
            inst.partner.live_target = None
            inst.partner = None
        self.free[inst.node] += inst.gpus
        self.gpus_allocated -= inst.gpus
        self.group[(inst.model, inst.role)].remove(inst)
        if self.sys.host_cache == "ttl":
            self.hostmem.released(inst.node, inst.model, now)

    # ---- serving
    def _wake(self, m: int, role: str, now: float) -> None:
        """Offer the queue to idle instances: serving before live, least loaded first."""
        q = self.queue[(m, role)]
        if not q:
            return
        for i in sorted((i for i in self.group[(m, role)] if i.accepting and not i.busy),
                        key=lambda i: (i.state != "serving", i.load, i.id)):
            self._kick(i, now)
            if not q:
                return

    def _dispatch(self, m: int, now: float) -> None:
        """Prefilled requests to decoders with room for their whole KV (never past capacity)."""
        q = self.queue[(m, "decode")]
        decoders = [i for i in self.group[(m, "decode")] if i.accepting]
        while q and decoders:
            r = q[0]
            need = self.inp[r] + self.out[r]
            fit = [i for i in decoders if i.kv_reserved + need <= i.kv_cap and i.n_running + i.incoming < self.spec.max_batch]
            if not fit:
                return
            # Packed, not spread: a decode step is memory-bound (nearly as long for 1 request as
            # for 30) and a decoder with any request is busy, so spreading keeps every decoder
            # busy with a few requests; packing lets the extra ones empty and be scaled down.
            d = min(fit, key=lambda i: (i.state != "serving", -(i.n_running + i.incoming), i.id))
            q.popleft()
            d.reserve(need)
            d.incoming += 1
            h = self.holder.pop(r)
            h.kv_reserved -= need
            self.push(now + self.inp[r] * self.spec.kv_bytes_per_token / self.kv_bytes_per_s, KV, (r, d))
            if h.state == "draining":
                self._maybe_release(h, now)
            elif not h.busy:
                self._kick(h, now)

    def _kv_arrived(self, r: int, d: Instance, now: float) -> None:
        d.incoming -= 1
        d.add_running(r, self.inp[r], self.out[r])
        self._kick(d, now)

    def _kick(self, inst: Instance, now: float) -> None:
        if inst.busy or not (inst.accepting or inst.state == "draining"):
            return
        partner = inst.partner if inst.state == "live" else None
        take = inst.accepting and inst.role != "decode" and (partner is None or partner.debt_s == 0)
        dur = inst.next_iteration(now, self.queue[(inst.model, inst.role)], self.inp, self.out, self.spec.cost.prefill_s,
                                  self.spec.cost.decode_s, self.spec.max_prefill_tokens, self.spec.max_batch, take)
        if dur is None:
            self._maybe_release(inst, now)
            return
        if partner is not None:
            # ZigZag: the layers not yet resident run on the partner, which pays for them next.
            # Only the part of the iteration before the target holds every layer is shared.
            partner.debt_s += (1.0 - inst.live_share) * min(dur, max(0.0, inst.ready_s - now))
            self.max_debt_s = max(self.max_debt_s, partner.debt_s)
            if not partner.busy:
                self._kick(partner, now)
        self.busy_time[(inst.model, inst.role)] += dur
        self.push(now + dur, ITER, inst)

    def _iteration_done(self, inst: Instance, now: float) -> None:
        inst.busy = False
        m = inst.model
        if inst.batch:
            for r in inst.batch:
                self.first[r] = now
                self.served_by[r] = inst.id
                if self.out[r] <= 1:
                    self.last[r] = now
                    self.unfinished -= 1
                    inst.kv_reserved -= self.inp[r] + self.out[r]
                elif inst.role == "prefill":
                    self.holder[r] = inst  # its KV stays here until a decoder has room
                    self.queue[(m, "decode")].append(r)
                else:
                    inst.add_running(r, self.inp[r], self.out[r])
            inst.batch = []
        elif inst.decoding:
            for r in inst.decode_done():
                self.last[r] = now
                self.unfinished -= 1
                inst.kv_reserved -= self.inp[r] + self.out[r]
                inst.kv_running -= self.inp[r] + self.out[r]
        if inst.live_target is not None and not inst.live_target.busy:
            self._kick(inst.live_target, now)
        self._kick(inst, now)
        if self.cfg.mode == "disaggregated":
            self._dispatch(m, now)

    # ---- policy
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
            value = len(self.queue[(m, role)]) + min(busy / self.cfg.tick_s, float(sum(1 for i in grp if i.accepting)))
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
            return MetricsSnapshot(now, in_flight=round(mean))
        return MetricsSnapshot(now, kv_usage=mean, in_flight=len(self.queue[(m, role)]))

    def _tick(self, now: float, k: int) -> None:
        if self.sys.static is None:
            # Models with no instance decide first: a GPU freed for them is not taken back by a model
            # that is merely growing.
            for m in sorted(range(self.models), key=lambda m: any(i.active for i in self.group[(m, self.roles[0])])):
                decisions = {}
                for role in self.roles:
                    g = (m, role)
                    st = self.states[g]
                    bounds = st.bounds
                    if role == "decode" and (self.queue[g] or any(i.active for i in self.group[(m, "prefill")])):
                        bounds = Bounds(max(1, bounds.min), bounds.max)  # prefillers need a decoder to finish
                    st = ScaleState(role, sum(1 for i in self.group[g] if i.active), bounds, True, st.below_since_s)
                    pol = self.cfg.decode_policy if role == "decode" else self.cfg.policy
                    decisions[role] = threshold(self._metric(m, role, k), st, pol)
                if "decode" in decisions and self.cfg.decoders_per_prefiller > 0:
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
        gpus = self.gpus_allocated
        copies = self._host_copies(now)
        self.cache_peak = max(self.cache_peak, copies)
        self.samples.append((now, gpus, copies, float(sum(len(q) for q in self.queue.values()))))

    def _initial_counts(self) -> dict[tuple[int, str], int]:
        cfg = self.cfg
        how = self.sys.static or "first"
        first_full = max(0, math.ceil(cfg.window_s / cfg.tick_s) - 1)
        wanted = {}
        for (m, role) in self.group:
            pol = cfg.decode_policy if role == "decode" else cfg.policy
            if pol.metric == "tokensPerSecond":
                need = pick(self.demand[(m, role)], how, first_full) / pol.upper
            else:
                cap = capacity_rps(self.spec, self.kv_cap, role, *mean_lengths(self.wl, m)) * cfg.target_utilization
                need = pick(self.rps[m], how, first_full) / cap
            wanted[(m, role)] = max(cfg.min_instances, min(self.max_instances, math.ceil(need - 1e-9)))
        # A static system never scales: every model and role keeps at least one instance.
        return fit_counts({g: max(1, w) for g, w in wanted.items()} if self.sys.static else wanted,
                          1 if self.sys.static else cfg.min_instances,
                          self.hw.hosts * (self.hw.gpus_per_host // self.spec.tp))

    def run(self) -> Result:
        cfg = self.cfg
        kinds = {"colocated": "colocated", "prefill": "prefill", "decode": "decode"}
        self.demand = {(m, role): demand_series(self.wl, cfg.window_s, cfg.tick_s, kinds[role], m)
                       for (m, role) in self.group}
        self.rps = {m: demand_series(self.wl, cfg.window_s, cfg.tick_s, "requests", m) for m in range(self.models)}
        for (m, role), count in sorted(self._initial_counts().items()):
            for _ in range(count):  # instances present before the trace starts
                node = self._pick_node(m)
                if node is None:
                    raise ValueError(f"the cluster has too few free GPUs for the initial {role} instances of model {m}")
                first = self._new_instance(node, m, role, 0.0, "serving")
                first.accept_from_s = first.ready_s = 0.0
                if self.sys.host_cache == "ttl":
                    self.hostmem.loaded(node, m, 0.0)
        self.cache_peak = self._host_copies(0.0)
        ticks = len(self.rps[0])
        self.push(cfg.tick_s, TICK, 0)
        n, nxt = len(self.arr), 0
        done_ticks = 0
        first_role = self.roles[0]
        while nxt < n or self.heap:
            if nxt < n and (not self.heap or self.arr[nxt] < self.heap[0][0]):
                now = self._now = self.arr[nxt]
                self.queue[(self.mdl[nxt], first_role)].append(nxt)
                self._wake(self.mdl[nxt], first_role, now)
                nxt += 1
                continue
            now, _, kind, obj = heapq.heappop(self.heap)
            self._now = now
            if kind == ITER:
                self._iteration_done(obj, now)  # type: ignore[arg-type]
            elif kind == KV:
                r, d = cast(tuple[int, Instance], obj)
                self._kv_arrived(r, d, now)
            elif kind == TICK:
                k = int(obj)  # type: ignore[call-overload]
                self._tick(now, k)
                # Keep deciding after the last arrival while requests are unfinished (a queue must
                # never be left without an instance to drain it).
                if k + 1 < ticks or (self.unfinished and k < ticks + 2000):
                    self.push((k + 2) * cfg.tick_s, TICK, k + 1)
                done_ticks += 1
                if self.progress is not None and done_ticks % 200 == 0:
                    self.progress(now)
            else:
                inst = cast(Instance, obj)
                if inst.state == "released":  # its load was cancelled
                    continue
                if kind == ACCEPT and inst.state == "loading":
                    inst.state = "live" if inst.accept_from_s < inst.ready_s else "serving"
                elif kind == READY:
                    if inst.state in ("loading", "live"):
                        inst.state = "serving"
                    if inst.partner is not None:
                        inst.partner.live_target = None
                    inst.slow, inst.partner = 1.0, None
                    if inst.from_ssd:
                        self.hostmem.loaded(inst.node, inst.model, now)
                    self.cache_peak = max(self.cache_peak, self._host_copies(now))
                self._kick(inst, now)
                self._wake(inst.model, inst.role, now)
                if inst.role == "decode":
                    self._dispatch(inst.model, now)
        if self.unfinished:
            raise RuntimeError(f"simulation of {self.sys.name} ended with {self.unfinished} unfinished requests")
        end = max(self.last)
        if self.progress is not None:
            self.progress(end)
        return Result.build(self, end)
