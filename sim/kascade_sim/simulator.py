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
Parts, one concept each, mixed into `Simulation` (which owns the state and the event loop):
`config.SimConfig`, `scaling.Scaling` (placement, plans, live pairs, release), `serving.Serving`
(queues, iterations, KV hand-off), `autoscaler.Autoscaler` (metrics, policies, initial counts).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import cast

from kascade_planner.conversion import chunk_budget, hand_back
from kascade_planner.pdratio import PdVelocity
from kascade_planner.policies import Bounds, ScaleState
from kascade_sim.arbiter import Arbiter
from kascade_sim.autoscaler import Autoscaler
from kascade_sim.config import SimConfig
from kascade_sim.events import ACCEPT, ITER, KV, READY, TICK
from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.hostmem import HostMemory
from kascade_sim.instance import Instance
from kascade_sim.pdpolicy import velocities
from kascade_sim.provisioning import demand_series
from kascade_sim.result import Result, ScaleEvent
from kascade_sim.scaling import Scaling
from kascade_sim.serving import Serving
from kascade_sim.systems import System
from kascade_sim.workload import Workload

__all__ = ["SimConfig", "Simulation", "SimulationStalled"]

log = logging.getLogger(__name__)


class SimulationStalled(RuntimeError):
    """A run ended with requests that never finished: a deadlock in the simulated system (a queue no
    instance will drain). `stuck` names each one as (request, model, arrival, where it waits)."""

    def __init__(self, system: str, stuck: list[tuple[int, int, float, str]]) -> None:
        self.system, self.stuck = system, stuck
        shown = "; ".join(f"request {r} (model {m}, arrived {t:.3f} s) {where}" for r, m, t, where in stuck[:5])
        more = f"; and {len(stuck) - 5} more" if len(stuck) > 5 else ""
        super().__init__(f"simulation of {system} stalled with {len(stuck)} unfinished requests: {shown}{more}")

class Simulation(Scaling, Serving, Autoscaler, Arbiter):
    def __init__(self, wl: Workload, hw: Hardware, spec: ModelSpec, sys: System, cfg: SimConfig = SimConfig(),
                 progress: Callable[[float], None] | None = None) -> None:
        if not wl.requests:
            raise ValueError(f"workload {wl.name!r} has no requests")
        self.wl, self.hw, self.spec, self.sys, self.cfg = wl, hw, spec, sys, cfg
        self.progress = progress
        self.topo = hw.topology()
        self.layout = spec.layout()
        self.kv_cap = spec.kv_capacity_tokens(hw)
        self._prefill_s, self._decode_s = spec.cost.prefill_s, spec.cost.decode_s  # bound once, called per iteration
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
        self.converted_prefills = 0  # requests prefilled by convertible decoders
        # (time, policy, input, answer) of every call into the operator's disaggregated policies (pdpolicy)
        self.policy_calls: list[tuple[float, str, object, object]] = []
        self.chunk_tokens = {m: chunk_budget(cfg.tbt_slo_s, None) for m in range(wl.models)}  # set every tick
        # a converted decoder's hand-back bound per model (set every tick from the conversion policy's answer),
        # what a prefill on a prefiller took lately (moving average, queue included), the prompts handed back
        self.hand_back_s = {m: hand_back(cfg.ttft_slo_s) for m in range(wl.models)}
        self.prefill_took: dict[int, float] = {}
        self.handed: set[int] = set()
        self.pd_velocity: dict[int, PdVelocity] = {}  # per model, from the cost model (pdpolicy.velocities)
        # per model, each finished request as (time, output tokens so far, requests so far): the engines'
        # kascade_request_generation_tokens histogram, read by pdpolicy for the output-length estimate
        self.finished: dict[int, list[tuple[float, float, float]]] = {m: [] for m in range(wl.models)}
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
        self._load_s: dict[int, float] = {}  # per model, the predicted load of its last scale-up (`_load_estimate`)
        self.hostmem = HostMemory([n.name for n in self.topo.nodes], hw.host_mem_gb * 1e9, spec.bytes, sys.keep_alive_s)
        self.cache_peak = 0
        self.loads = 0
        self._now = 0.0
        self.arbitrated = cfg.arbitration if cfg.arbitration is not None else (
            cfg.mode == "colocated" and wl.models > 1)
        self.short_reasons = {}  # arbiter: why a model got less than it asked
        self.preemptions = 0
        self.reserved = {}  # arbiter: GPUs preempted for a model, still draining

    # ---- event plumbing
    def push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

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
        if cfg.mode == "disaggregated":
            self.chunk_tokens = {m: chunk_budget(cfg.tbt_slo_s, velocities(self, m).prefill_effective)
                                 for m in range(self.models)}
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
            raise SimulationStalled(self.sys.name, self._stuck())
        end = max(self.last)
        if self.progress is not None:
            self.progress(end)
        return Result.build(self, end)

    def _stuck(self) -> list[tuple[int, int, float, str]]:
        """Every unfinished request with where it waits (for `SimulationStalled`)."""
        where: dict[int, str] = {}
        for (_, role), q in self.queue.items():
            for r in q:
                where[r] = f"waits in the {role} queue" + (" (handed back by a decoder)" if r in self.handed else "")
        for inst in self.instances:
            for r in inst.batch:
                where[r] = f"in a batch on {inst.id} ({inst.role}, {inst.state})"
            for _, r in inst.running:
                where[r] = f"decoding on {inst.id} ({inst.state})"
            if inst.chunk_left:
                where[inst.chunk_req] = f"chunk-prefilled on {inst.id} ({inst.chunk_left} tokens left)"
        return [(r, self.mdl[r], self.arr[r], where.get(r, "nowhere (lost)"))
                for r in range(len(self.arr)) if math.isnan(self.last[r])]

