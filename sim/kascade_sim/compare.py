"""Side-by-side comparison: one workload, several systems, the ratios the papers report.

Data flow: (Workload, Hardware, ModelSpec, system names, SimConfig) -> one `Simulation` per system ->
`Result`s -> a JSON-ready dict with each system's summary and Kascade's TTFT reductions versus
ServerlessLLM and AllCache and its GPU time versus static peak provisioning.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.result import Result
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Workload


def run_systems(wl: Workload, hw: Hardware, spec: ModelSpec, names: Sequence[str], cfg: SimConfig = SimConfig(),
                progress: Callable[[str, float], None] | None = None) -> tuple[list[Result], float]:
    """Run every system; return the results and the wall-clock seconds spent simulating."""
    results = []
    t0 = time.perf_counter()
    for name in names:
        cb = (lambda t, n=name: progress(n, t)) if progress is not None else None
        results.append(Simulation(wl, hw, spec, system(name), cfg, cb).run())
    return results, time.perf_counter() - t0


def comparison(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    by = {r.system: r.summary() for r in results}
    out: dict[str, Any] = {"systems": by, "sim_wall_s": wall_s,
                           "sim_requests_per_s": sum(r.requests for r in results) / wall_s if wall_s > 0 else None}
    k = by.get("kascade")

    def reduction(other: str) -> float | None:
        if k is None or other not in by or by[other]["ttft_mean_s"] <= 0:
            return None
        return float(1 - k["ttft_mean_s"] / by[other]["ttft_mean_s"])

    out["ttft_mean_reduction_vs_sllm"] = reduction("serverlessllm")
    out["ttft_mean_reduction_vs_allcache"] = reduction("allcache")
    out["ttft_mean_reduction_vs_lambdascale"] = reduction("lambdascale")
    out["ttft_mean_reduction_vs_noconv"] = reduction("kascade-noconv")
    peak = by.get("static-peak")
    out["gpu_time_vs_static_peak"] = (k["gpu_seconds"] / peak["gpu_seconds"]) if k and peak else None
    return out
