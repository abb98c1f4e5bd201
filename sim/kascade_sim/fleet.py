"""One fleet for many models versus a pool per model: the GPU time each needs and the TTFT it gives.

Data flow: a multi-model `Workload` + `Hardware` + `ModelSpec` + `SimConfig` ->
- the shared fleet: one `Simulation` of every model on the whole cluster with the planner's arbitration
  (`SimConfig.arbitration`: `arbiter.Arbiter` calls `kascade_planner.arbitration.arbitrate` every tick), for
  Kascade and, on the same fleet and policy, ServerlessLLM and AllCache;
- per-model pools (Kascade's chart today: `pool.model` names one model), one `Simulation` per model: each model
  alone on the whole cluster, its pool sized for its own peak (`kascade-per-model-pools`: the TTFT it gets when it
  never waits for another model), and each model on an equal share of the cluster (`kascade-equal-pools`);
-> per run: GPU-seconds bound to a model (`gpu_seconds`), the GPUs a pool must hold for the run so no burst waits
for a pod (`pool_gpu_seconds`: peak GPUs bound at once x the trace span; per-model pools: the sum of each model's
own peak), mean and p99 TTFT -> `fleet_gpu_time_over_per_model_pools` (pool GPU time, shared fleet over
per-model pools) and the same ratio on bound GPU-seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.instance import Instance
from kascade_sim.result import percentile
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload

SIMULATED = ("simulated (discrete-event, no GPU): engines' step times from the roofline cost model, weight loads "
             "from the planner's plans and cost model; GPU time = GPUs bound to a model; pool GPU time = peak GPUs "
             "bound at once x trace span (what a pool sized for its peak holds)")


@dataclass(frozen=True)
class FleetRun:
    name: str
    gpu_seconds: float
    pool_gpu_seconds: float
    peak_gpus: int
    ttft_mean_s: float
    ttft_p99_s: float
    requests: int
    preemptions: int = 0
    short_rounds: int = 0  # ticks in which some model got fewer GPUs than it asked for
    host_cache_bytes_peak: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def peak_gpus(instances: list[Instance]) -> int:
    """The most GPUs bound at once (instances' alloc..release intervals)."""
    edges = sorted([(i.alloc_s, i.gpus) for i in instances]
                   + [(i.released_s, -i.gpus) for i in instances if i.released_s is not None],
                   key=lambda e: (e[0], e[1]))  # a release and a bind at one instant: the release first
    now = peak = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


def partition(hw: Hardware, n: int) -> Hardware:
    """One model's equal share of the cluster: hosts split n ways, or each host's GPUs."""
    if hw.hosts % n == 0:
        return replace(hw, hosts=hw.hosts // n)
    if n % hw.hosts == 0 and hw.gpus_per_host % (n // hw.hosts) == 0:
        return replace(hw, hosts=1, gpus_per_host=hw.gpus_per_host // (n // hw.hosts))
    raise ValueError(f"models: {n} models do not split {hw.hosts} hosts x {hw.gpus_per_host} GPUs into equal pools")


def _model_only(wl: Workload, m: int) -> Workload:
    return Workload(f"{wl.name}[model {m}]", tuple(Request(r.arrival_s, r.input_tokens, r.output_tokens, 0)
                                                   for r in wl.requests if r.model == m))


def _run(name: str, sim: Simulation, span: float) -> tuple[FleetRun, list[float]]:
    res = sim.run()
    tt = sorted(res.ttft_s)
    peak = peak_gpus(sim.instances)
    return FleetRun(name, res.gpu_seconds, peak * span, peak, sum(tt) / len(tt), percentile(tt, 99), len(tt),
                    sim.preemptions, len({t for v in sim.short_reasons.values() for t, _ in v}),
                    res.host_cache_bytes_peak), tt


def fleet_comparison(wl: Workload, hw: Hardware, spec: ModelSpec, cfg: SimConfig,
                     baselines: tuple[str, ...] = ("serverlessllm", "allcache")) -> dict[str, Any]:
    if wl.models < 2:
        raise ValueError(f"models: a fleet comparison needs at least 2 models, the workload has {wl.models}")
    if cfg.mode != "colocated":
        raise ValueError("mode: the fleet comparison runs colocated (arbitration is colocated only)")
    span = wl.duration_s
    fleet_cfg = replace(cfg, arbitration=True)
    runs = [_run("kascade-fleet", Simulation(wl, hw, spec, system("kascade"), fleet_cfg), span)[0]]
    part = partition(hw, wl.models)
    # per-model pools, each sized for its model's own peak (the model alone on the whole cluster: it waits for no
    # other model), and, as the chart deploys them today, an equal share of the cluster each
    for name, pool_hw in (("kascade-per-model-pools", hw), ("kascade-equal-pools", part)):
        per_model = [_run(f"model {m}", Simulation(_model_only(wl, m), pool_hw, spec, system("kascade"),
                                                    replace(cfg, arbitration=False)), span)
                     for m in range(wl.models) if any(r.model == m for r in wl.requests)]
        tt = sorted(t for _, ts in per_model for t in ts)
        each = [r for r, _ in per_model]
        runs.append(FleetRun(name, sum(r.gpu_seconds for r in each), sum(r.pool_gpu_seconds for r in each),
                             sum(r.peak_gpus for r in each), sum(tt) / len(tt), percentile(tt, 99), len(tt),
                             host_cache_bytes_peak=sum(r.host_cache_bytes_peak for r in each)))
    for b in baselines:
        runs.append(_run(f"{b}-fleet", Simulation(wl, hw, spec, system(b), fleet_cfg), span)[0])
    by = {r.name: r for r in runs}
    fleet, pools = by["kascade-fleet"], by["kascade-per-model-pools"]
    return {
        "simulated": SIMULATED,
        "workload": wl.name, "models": wl.models, "requests": len(wl.requests), "span_s": span,
        "cluster": f"{hw.hosts}x{hw.gpus_per_host} {hw.name}", "per_model_pool": f"{part.hosts}x{part.gpus_per_host}",
        "runs": {r.name: r.as_dict() for r in runs},
        "fleet_gpu_time_over_per_model_pools": fleet.pool_gpu_seconds / pools.pool_gpu_seconds
        if pools.pool_gpu_seconds else math.nan,
        "fleet_bound_gpu_time_over_per_model_pools": fleet.gpu_seconds / pools.gpu_seconds
        if pools.gpu_seconds else math.nan,
    }
