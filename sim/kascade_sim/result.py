"""Results of one simulation: per-request latencies, percentiles, CDFs, SLO attainment, GPU time,
host-cache bytes and scale events, as a JSON-ready object.

Data flow: a finished `Simulation` (first/last token per request, instances, samples) -> `Result`
(`summary()` for tables and the benchmark, `to_dict()` for the JSON file, series for the plots).
SLOs: the papers' 5x rule (5 x the latency of the request alone on an idle instance) and absolute ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kascade_sim.simulator import Simulation


@dataclass(frozen=True)
class ScaleEvent:
    time_s: float
    direction: str  # up | down
    count: int
    reason: str
    predicted_load_s: float
    role: str = "colocated"
    model: int = 0
    loaded: bool = True  # up: new instances loaded (False: draining ones taken back, nothing to load)


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_vals:
        return math.nan
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def cdf(sorted_vals: list[float], points: int = 100) -> list[tuple[float, float]]:
    if not sorted_vals:
        return []
    n = len(sorted_vals)
    return [(sorted_vals[min(n - 1, int(i * n / points))], min(1.0, (int(i * n / points) + 1) / n))
            for i in range(points + 1)]


@dataclass(frozen=True)
class Result:
    system: str
    workload: str
    requests: int
    arrival_s: tuple[float, ...]
    ttft_s: tuple[float, ...]
    tbt_s: tuple[float, ...]  # NaN for single-token outputs
    slo5_ttft_s: tuple[float, ...]
    slo5_tbt_s: tuple[float, ...]
    ttft_slo_s: float
    tbt_slo_s: float
    gpu_seconds: float
    end_s: float
    host_cache_bytes_peak: int
    host_cache_hosts_touched: int
    events: tuple[ScaleEvent, ...]
    samples: tuple[tuple[float, int, int, float], ...]
    models: int = 1
    host_cache_miss_rate: float = 0.0  # ServerlessLLM: share of loads that found no warm host copy
    host_cache_evictions: int = 0
    kv_peak_fraction: float = 0.0  # highest KV reservation of any instance / its capacity
    clipped_requests: int = 0  # requests longer than the context, clipped
    loads: int = 0  # instances loaded by scale-ups
    converted_prefills: int = 0  # requests prefilled by convertible decoders
    handbacks: int = 0  # prompts a converted decoder handed back to the prefillers

    @staticmethod
    def build(sim: Simulation, end: float) -> Result:
        ttft = tuple(f - a for f, a in zip(sim.first, sim.arr, strict=True))
        tbt = tuple((la - f) / (o - 1) if o > 1 else math.nan
                    for f, la, o in zip(sim.first, sim.last, sim.out, strict=True))
        c = sim.spec.cost
        gpu_s = sum(
            max(0.0, (i.released_s if i.released_s is not None else end) - i.alloc_s) * i.gpus for i in sim.instances
        )
        size = sim.spec.bytes
        hm = sim.hostmem
        touched = len(hm.touched) if sim.sys.host_cache == "ttl" else sim.cache_peak
        peak = max(sim.cache_peak, hm.peak_copies) if sim.sys.host_cache == "ttl" else sim.cache_peak
        kv_peak = max((i.kv_peak / i.kv_cap for i in sim.instances), default=0.0)
        return Result(sim.sys.name, sim.wl.name, len(ttft), tuple(sim.arr), ttft, tbt,
                      tuple(5 * c.prefill_s(i) for i in sim.inp), tuple(5 * c.decode_s(1, i) for i in sim.inp),
                      sim.cfg.ttft_slo_s, sim.cfg.tbt_slo_s, gpu_s, end, peak * size, touched,
                      tuple(sim.events), tuple(sim.samples), sim.models,
                      hm.miss_rate if sim.sys.host_cache == "ttl" else 0.0, hm.evictions, kv_peak, sim.clipped,
                      sim.loads, sim.converted_prefills, len(sim.handed))

    def summary(self) -> dict[str, Any]:
        tt = sorted(self.ttft_s)
        tb = sorted(x for x in self.tbt_s if x == x)
        ok5 = sum(1 for t, b, st, sb in zip(self.ttft_s, self.tbt_s, self.slo5_ttft_s, self.slo5_tbt_s, strict=True)
                  if t <= st and (b != b or b <= sb))
        ok_abs = sum(1 for t, b in zip(self.ttft_s, self.tbt_s, strict=True)
                     if t <= self.ttft_slo_s and (b != b or b <= self.tbt_slo_s))
        return {
            "system": self.system, "workload": self.workload, "requests": self.requests,
            "ttft_mean_s": sum(tt) / len(tt), "ttft_p50_s": percentile(tt, 50), "ttft_p90_s": percentile(tt, 90),
            "ttft_p99_s": percentile(tt, 99),
            "tbt_mean_s": sum(tb) / len(tb) if tb else math.nan, "tbt_p50_s": percentile(tb, 50),
            "tbt_p99_s": percentile(tb, 99),
            "slo_attainment_5x": ok5 / self.requests, "slo_attainment_abs": ok_abs / self.requests,
            "gpu_seconds": self.gpu_seconds, "makespan_s": self.end_s,
            "host_cache_bytes_peak": self.host_cache_bytes_peak,
            "host_cache_hosts_touched": self.host_cache_hosts_touched,
            "scale_ups": sum(e.count for e in self.events if e.direction == "up" and e.loaded),
            "taken_back": sum(e.count for e in self.events if e.direction == "up" and not e.loaded),
            "scale_downs": sum(e.count for e in self.events if e.direction == "down"),
            "models": self.models, "host_cache_miss_rate": self.host_cache_miss_rate,
            "host_cache_evictions": self.host_cache_evictions, "kv_peak_fraction": self.kv_peak_fraction,
            "clipped_requests": self.clipped_requests, "loads": self.loads,
            "converted_prefills": self.converted_prefills, "handbacks": self.handbacks,
            # over the scale-ups that loaded (an instance taken back while draining loads nothing)
            "mean_predicted_load_s": (sum(e.predicted_load_s for e in self.events if e.direction == "up")
                                      / max(1, sum(1 for e in self.events if e.direction == "up" and e.loaded))),
        }

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"summary": self.summary(),
                             "ttft_cdf": cdf(sorted(self.ttft_s)),
                             "tbt_cdf": cdf(sorted(x for x in self.tbt_s if x == x)),
                             "events": [e.__dict__ for e in self.events],
                             "samples": [list(s) for s in self.samples]}
        if per_request:
            d["requests"] = [{"arrival_s": a, "ttft_s": t, "tbt_s": None if b != b else b}
                             for a, t, b in zip(self.arrival_s, self.ttft_s, self.tbt_s, strict=True)]
        return d
