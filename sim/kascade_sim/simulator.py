"""The discrete-event core: a workload replayed on a cluster under one system configuration.

Data flow: `Workload` + `Hardware` + `ModelSpec` + `System` + policy -> events on one heap (iteration
ends, instances becoming able to serve, policy ticks; arrivals are merged from the sorted trace) ->
per-request first/last token times -> `result.Result`. Scale-ups call the planner: `make_plan` builds
the chain / binomial / local plan and its cost model gives every block's arrival time at every target,
which decides when a target may serve (live: first layer; λScale: when the receivers jointly hold the
model; stop-the-world: last block). Deterministic: no wall clock; ties broken by a sequence number.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kascade_planner.builder import make_plan
from kascade_planner.cost import predict
from kascade_planner.plan import Instance as PlanInstance
from kascade_planner.policies import Bounds, MetricsSnapshot, ScaleState, Threshold, threshold
from kascade_planner.zigzag import PairSetting, ilp_free
from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.instance import Instance
from kascade_sim.result import Result, ScaleEvent
from kascade_sim.systems import System
from kascade_sim.workload import Request, Workload

log = logging.getLogger(__name__)

ITER, ACCEPT, READY, TICK, KV = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class SimConfig:
    policy: Threshold = field(default_factory=lambda: Threshold(upper=6000.0, lower=2000.0, scale_down_delay_s=5.0))
    tick_s: float = 0.5  # policy evaluation period
    window_s: float = 2.0  # demand measured over this window
    min_instances: int = 1
    max_instances: int | None = None  # default: every GPU
    seed: int = 0
    ttft_slo_s: float = 1.0
    tbt_slo_s: float = 0.1
    # "disaggregated": prefill and decode instances scale separately (prefill on input tokens/s, decode
    # on output tokens/s); KV moves prefill -> decode over the scale-out network after each prefill.
    mode: str = "colocated"
    decode_policy: Threshold = field(default_factory=lambda: Threshold(upper=1500.0, lower=300.0, scale_down_delay_s=5.0))

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode must be colocated or disaggregated, got {self.mode!r}")


def demand_series(wl: Workload, window_s: float, tick_s: float, what: str = "colocated") -> list[float]:
    """Tokens per second demanded over a sliding window, sampled every tick (policy input)."""
    out = []
    reqs = wl.requests
    lo = hi = 0
    acc = 0
    t = tick_s
    end = wl.duration_s + tick_s
    while t <= end:
        while hi < len(reqs) and reqs[hi].arrival_s <= t:
            acc += _tokens(reqs[hi], what)
            hi += 1
        while lo < hi and reqs[lo].arrival_s <= t - window_s:
            acc -= _tokens(reqs[lo], what)
            lo += 1
        out.append(acc / window_s)
        t += tick_s
    return out


def _tokens(r: Request, what: str) -> int:
    if what == "prefill":
        return r.input_tokens
    if what == "decode":
        return r.output_tokens
    return r.input_tokens + r.output_tokens


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
        n = len(wl.requests)
        self.arr = [r.arrival_s for r in wl.requests]
        self.inp = [r.input_tokens for r in wl.requests]
        self.out = [r.output_tokens for r in wl.requests]
        self.first = [math.nan] * n
        self.last = [math.nan] * n
        self.served_by: list[str] = [""] * n
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.free = {node.name: node.gpus for node in self.topo.nodes}
        self.instances: list[Instance] = []
        self.next_id = 0
        self.events: list[ScaleEvent] = []
        self.cache_expiry: dict[str, float] = {}  # ServerlessLLM: host -> cache valid until
        self.cache_touched: set[str] = set()
        self.cache_peak = 0
        self.samples: list[tuple[float, int, int, float]] = []  # (t, gpus, host-cached copies, demand)
        self.max_instances = cfg.max_instances or hw.total_gpus // spec.tp
        self.roles = ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode")
        self.states = {role: ScaleState(role, 0, Bounds(cfg.min_instances, self.max_instances), host_cached=True)
                       for role in self.roles}
        self.kv_bytes_per_s = hw.rdma_gbps * spec.tp * 1e9 / 8
        self._zigzag: dict[tuple[float, int], float] = {}

    # ---- event plumbing
    def push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    # ---- placement and data path
    def _pick_node(self) -> str | None:
        cands = [n for n, f in self.free.items() if f >= self.spec.tp]
        if not cands:
            return None
        if self.sys.host_cache == "ttl":  # ServerlessLLM is locality-aware: prefer hosts with a cached copy
            now = self._now
            return min(cands, key=lambda n: (self.cache_expiry.get(n, -1.0) <= now, -self.free[n], n))
        return min(cands, key=lambda n: (-self.free[n], n))

    def _host_copies(self, now: float) -> int:
        if self.sys.host_cache == "all":
            return len(self.topo.nodes)
        if self.sys.host_cache == "one":
            return 1
        if self.sys.host_cache == "ttl":
            return sum(1 for e in self.cache_expiry.values() if e > now)
        return 0

    def _scale_up(self, now: float, count: int, reason: str, role: str = "colocated") -> None:
        targets: list[Instance] = []
        for _ in range(count):
            node = self._pick_node()
            if node is None:
                break
            self.free[node] -= self.spec.tp
            inst = Instance(f"i{self.next_id}", node, self.spec.tp, now, self.kv_cap, role=role)
            self.next_id += 1
            targets.append(inst)
        if not targets:
            return
        self.instances.extend(targets)
        ptargets = [PlanInstance(t.id, t.node, t.gpus) for t in targets]
        serving = [i for i in self.instances if i.state == "serving"]
        if self.sys.transfer == "local":
            cached = [n for n, e in self.cache_expiry.items() if e > now] if self.sys.host_cache == "ttl" \
                else [n.name for n in self.topo.nodes]
            plan = make_plan(self.topo, self.layout, (), ptargets, "local", host_cached_nodes=cached, predict=False)
        else:
            sources = [PlanInstance(i.id, i.node, i.gpus) for i in serving]
            if self.sys.host_cache == "one" or not sources:
                sources.append(PlanInstance("host:pool", self.topo.nodes[0].name, self.spec.tp, "host"))
            algo = self.sys.transfer if len(sources) > 0 else "chain"
            # KV flows prefill -> decode must not share links with weight transfers (source pruning).
            kv = [(p.id, d.id) for p in serving if p.role == "prefill" for d in serving if d.role == "decode"]
            plan = make_plan(self.topo, self.layout, sources, ptargets, algo, kv_flows=kv, predict=False)
        pred = predict(plan, self.topo)
        arrival = dict(pred.arrival)
        joint = max(min(dict(arrival[t.id])[b] for t in targets) for b in self.layout.block_ids)
        # The most loaded serving instances are the live partners (they are the overloaded ones).
        partners = sorted((i for i in serving if i.role == role), key=lambda i: (-i.load, i.id))
        for k, t in enumerate(targets):
            times = sorted(now + s for _, s in arrival[t.id])
            t.block_times = times
            t.ready_s = times[-1]
            if self.sys.host_cache == "ttl":
                self.cache_expiry[t.node] = math.inf  # in use: cached while an instance lives there
                self.cache_touched.add(t.node)
            first_layer = now + dict(arrival[t.id])["layer.0"]
            if self.sys.serving == "live" and partners:
                t.accept_from_s = max(first_layer, now + dict(arrival[t.id])["embed"])
                t.partner = partners[k % len(partners)]
                t.live_share = self._live_share(t.partner, t.ready_s - now)
            elif self.sys.serving == "pipeline" and len(targets) > 1:
                t.accept_from_s = now + joint
                t.slow = 1.0 + self.sys.pipeline_overhead
            else:
                t.accept_from_s = t.ready_s
            t.accept_from_s = min(t.accept_from_s, t.ready_s)
            self.push(t.accept_from_s, ACCEPT, t)
            self.push(t.ready_s, READY, t)
        self.cache_peak = max(self.cache_peak, self._host_copies(now))
        self.events.append(ScaleEvent(now, "up", len(targets), reason, round(pred.makespan, 6), role))

    def _live_share(self, partner: Instance, load_s: float) -> float:
        """Share of the layer work a loading target takes over from its partner, from the planner's
        ILP-free ZigZag schedule of the partner's queue (load time per layer in layer computations)."""
        c = self.spec.cost
        batch_s = c.decode_s(max(1, partner.n_running), partner.kv_running)
        if partner.waiting:
            batch_s = max(batch_s, c.prefill_s(min(self.spec.max_prefill_tokens,
                                                   sum(self.inp[r] for r in list(partner.waiting)[:16]))))
        layers = self.spec.layers
        ratio = (load_s / layers) / (batch_s / layers)
        # Log-bucketed so a run reuses a handful of schedules (each costs tens of ms).
        key = (round(math.log2(max(ratio, 1e-3)) * 4) / 4, max(1, min(12, partner.load)))
        if key not in self._zigzag:
            sched = ilp_free(PairSetting(layers, 2 ** key[0], key[1]))
            self._zigzag[key] = sum(sched.target_layers) / (key[1] * layers)
        return self._zigzag[key]

    def _scale_down(self, now: float, count: int, reason: str, role: str = "colocated") -> None:
        partners = {id(i.partner) for i in self.instances if i.partner is not None and i.state in ("loading", "live")}
        cands = sorted((i for i in self.instances if i.state == "serving" and i.role == role and id(i) not in partners),
                       key=lambda i: (i.load, -i.alloc_s, i.id))
        victims = cands[:count]
        for v in victims:
            v.state = "draining"
            self._maybe_release(v, now)
        if victims:
            self.events.append(ScaleEvent(now, "down", len(victims), reason, 0.0, role))

    def _maybe_release(self, inst: Instance, now: float) -> None:
        if inst.state != "draining" or not inst.idle:
            return
        inst.state = "released"
        inst.released_s = now
        self.free[inst.node] += inst.gpus
        if self.sys.host_cache == "ttl" and not any(
                i.node == inst.node and i.state not in ("released",) for i in self.instances):
            self.cache_expiry[inst.node] = now + self.sys.keep_alive_s

    # ---- serving
    def _route(self, r: int, now: float, role: str = "") -> Instance:
        role = role or self.roles[0]
        best = None
        for i in self.instances:
            if i.accepting and i.role == role and (best is None or (i.load, i.state != "serving") < (best.load, best.state != "serving")):
                best = i
        if best is None:  # every instance is still loading: queue on the one ready first
            best = min((i for i in self.instances if i.state == "loading" and i.role == role),
                       key=lambda i: (i.accept_from_s, i.id))
        if role == "decode":
            return best
        best.waiting.append(r)
        self.served_by[r] = best.id
        self._kick(best, now)
        return best

    def _kv_arrived(self, r: int, now: float) -> None:
        inst = self._route(r, now, "decode")
        inst.kv_reserved += min(self.inp[r] + self.out[r], inst.kv_cap)
        inst.add_running(r, self.inp[r], self.out[r])
        self._kick(inst, now)

    def _kick(self, inst: Instance, now: float) -> None:
        if inst.busy or (not inst.accepting and inst.state != "draining"):
            return
        dur = inst.next_iteration(now, self.inp, self.out, self.spec.cost.prefill_s, self.spec.cost.decode_s,
                                  self.spec.max_prefill_tokens, self.spec.max_batch)
        if dur is not None:
            if inst.state == "live" and inst.partner is not None:
                # ZigZag: the layers not yet resident run on the partner, which pays for them.
                inst.partner.debt_s += (1.0 - inst.live_share) * dur
            self.push(now + dur, ITER, inst)
        else:
            self._maybe_release(inst, now)

    def _iteration_done(self, inst: Instance, now: float) -> None:
        inst.busy = False
        if inst.batch:
            for r in inst.batch:
                self.first[r] = now
                if self.out[r] <= 1:
                    self.last[r] = now
                    inst.kv_reserved -= min(self.inp[r] + self.out[r], inst.kv_cap)
                elif inst.role == "prefill":
                    # The KV cache moves to a decoder; the prefiller's memory is free again.
                    inst.kv_reserved -= min(self.inp[r] + self.out[r], inst.kv_cap)
                    self.push(now + self.inp[r] * self.spec.kv_bytes_per_token / self.kv_bytes_per_s, KV, r)
                else:
                    inst.add_running(r, self.inp[r], self.out[r])
            inst.batch = []
        else:
            for r in inst.decode_done():
                self.last[r] = now
                inst.kv_reserved -= min(self.inp[r] + self.out[r], inst.kv_cap)
                inst.kv_running -= self.inp[r] + self.out[r]
        self._kick(inst, now)

    # ---- policy
    def _policy(self, role: str) -> Threshold:
        return self.cfg.decode_policy if role == "decode" else self.cfg.policy

    def _tick(self, now: float, demand: dict[str, float]) -> None:
        total = sum(demand.values())
        if self.sys.static is None:
            for role in self.roles:
                active = [i for i in self.instances if i.role == role and i.state in ("loading", "live", "serving")]
                in_flight = sum(i.load for i in self.instances if i.role == role)
                st = self.states[role]
                st = ScaleState(role, len(active), st.bounds, True, st.below_since_s)
                d = threshold(MetricsSnapshot(now, demand[role], 0.0, in_flight), st, self._policy(role))
                self.states[role] = d.state
                if d.change > 0:
                    self._scale_up(now, d.change, d.reason, role)
                elif d.change < 0:
                    self._scale_down(now, -d.change, d.reason, role)
        gpus = sum(i.gpus for i in self.instances if i.state != "released")
        self.samples.append((now, gpus, self._host_copies(now), total))

    def _initial(self, demand: list[float], role: str) -> int:
        if self.sys.static == "peak":
            need = max(demand)
        elif self.sys.static == "average":
            need = sum(demand) / len(demand)
        else:
            need = demand[0] if demand else 0.0
        upper = self._policy(role).upper
        return max(self.cfg.min_instances, min(self.max_instances, math.ceil(need / upper - 1e-9)))

    def run(self) -> Result:
        cfg = self.cfg
        demand = {role: demand_series(self.wl, cfg.window_s, cfg.tick_s, role) for role in self.roles}
        self._now = 0.0
        for role in self.roles:
            for _ in range(self._initial(demand[role], role)):  # instances present before the trace starts
                node = self._pick_node()
                if node is None:
                    raise ValueError(f"the cluster has too few GPUs for the initial {role} instances")
                self.free[node] -= self.spec.tp
                first = Instance(f"i{self.next_id}", node, self.spec.tp, 0.0, self.kv_cap, "serving", 0.0, 0.0, role=role)
                self.next_id += 1
                self.instances.append(first)
                if self.sys.host_cache == "ttl":
                    self.cache_expiry[node] = math.inf
                    self.cache_touched.add(node)
        self.cache_peak = self._host_copies(0.0)
        ticks = len(demand[self.roles[0]])
        for k in range(ticks):
            self.push((k + 1) * cfg.tick_s, TICK, k)
        n, nxt = len(self.arr), 0
        done_ticks = 0
        while nxt < n or self.heap:
            if nxt < n and (not self.heap or self.arr[nxt] < self.heap[0][0]):
                now = self._now = self.arr[nxt]
                self._route(nxt, now)
                nxt += 1
                continue
            now, _, kind, obj = heapq.heappop(self.heap)
            self._now = now
            if kind == ITER:
                self._iteration_done(obj, now)  # type: ignore[arg-type]
            elif kind == TICK:
                k = int(obj)  # type: ignore[call-overload]
                self._tick(now, {role: demand[role][k] for role in self.roles})
                done_ticks += 1
                if self.progress is not None and done_ticks % 200 == 0:
                    self.progress(now)
            elif kind == KV:
                self._kv_arrived(int(obj), now)  # type: ignore[call-overload]
            elif kind == ACCEPT:
                inst: Instance = obj  # type: ignore[assignment]
                if inst.state == "loading":
                    inst.state = "live" if inst.accept_from_s < inst.ready_s else "serving"
                    self._kick(inst, now)
            elif kind == READY:
                inst = obj  # type: ignore[assignment]
                if inst.state in ("loading", "live"):
                    inst.state = "serving"
                inst.slow, inst.partner = 1.0, None
                self._kick(inst, now)
        end = max(x for x in self.last if x == x) if any(x == x for x in self.last) else 0.0
        if self.progress is not None:
            self.progress(end)
        return Result.build(self, end)
