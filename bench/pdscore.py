"""bench/pd.py's scoring: SLO attainment over a trace's outcomes (`summarize`), and the simulator's side of the
same trace (`sim_side`: kascade_sim with the operator's policies, scored by the same `summarize`).

Data flow: the bench's per-request outcomes (TTFT, mean TBT, tokens; or a failure's message) + the trace (which
requests are the burst's) + the SLOs -> `summarize` -> one setup's row of pd.json. `sim_side` runs the trace,
time-compressed to the simulator's speeds (`longest`: the calibration prompt's tokens), through each setup.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pdconvert import converted_digest

Outcome = tuple[float, float, int] | str  # (TTFT s, mean TBT s, tokens) or the failure's message
Request = tuple[float, list[int], bool]  # (arrival s, prompt, in the burst)


def pct(vals: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN when empty), as kascade_sim.result.percentile."""
    vals = sorted(vals)
    return vals[max(0, min(len(vals) - 1, math.ceil(q / 100 * len(vals)) - 1))] if vals else math.nan


def summarize(r: dict[str, Any], reqs: list[Request], ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """Attainment over every request of the trace (a failure misses both SLOs); TTFT also over the burst's
    long prompts and the background's short ones apart."""
    res: list[Outcome] = r["results"]
    ok = [x for x in res if not isinstance(x, str)]
    ttft, tbt = [x[0] for x in ok], [x[1] for x in ok]
    n = len(res)

    def att(sel: list[tuple[float, float, int]], slo: float, k: int) -> float:
        return sum(x[k] <= slo for x in sel) / len(sel) if sel else math.nan

    t0 = r.get("t0")
    when = [{"at_s": round(c["t"] - t0, 2), "action": "take back" if "take back" in c["reason"] else "convert",
             "chunk_tokens": c.get("chunk_tokens")} for c in r["conversions"]] if t0 is not None else None
    burst = [x for x, q in zip(res, reqs, strict=True) if q[2] and not isinstance(x, str)]
    bg = [x for x, q in zip(res, reqs, strict=True) if not q[2] and not isinstance(x, str)]
    nb = sum(q[2] for q in reqs)
    return {
        "requests": n,
        "failures": n - len(ok),
        "failure_examples": sorted({x for x in res if isinstance(x, str)})[:3],
        "ttft_slo_attainment": sum(t <= ttft_slo for t in ttft) / n,
        "tbt_slo_attainment": sum(t <= tbt_slo for t in tbt) / n,
        "both_slo_attainment": sum(a <= ttft_slo and b <= tbt_slo for a, b in zip(ttft, tbt, strict=True)) / n,
        "burst_ttft_slo_attainment": att(burst, ttft_slo, 0) * len(burst) / nb if nb else math.nan,
        "background_ttft_slo_attainment": att(bg, ttft_slo, 0) * len(bg) / (n - nb) if n > nb else math.nan,
        "background_tbt_slo_attainment": att(bg, tbt_slo, 1) * len(bg) / (n - nb) if n > nb else math.nan,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "burst_ttft_s": [round(x[0], 3) for x in burst],  # in arrival order: where the tail comes from
        "tbt_p50_s": pct(tbt, 50),
        "tbt_p99_s": pct(tbt, 99),
        "wall_s": r["wall_s"],
        "remote_prefills": r["remote_prefills"],
        "local_fallbacks": r["fallbacks"],
        "conversions": r["conversions"],
        "conversions_at": when,
        "steps": r.get("steps"),
        # the converted decoder's measured share of a prefiller while converted (the policy's input), and the
        # prompts it prefilled itself (requests it served whose KV did not come from a prefill engine) / handed back
        "converted_digest": converted_digest(r.get("policy_samples") or []),
        "decoder_local_prefills": r.get("decoder_local_prefills"),
        "decoder_handbacks": r.get("decoder_handbacks"),
        "emulation_floor": r.get("emulation_floor"),
        "policy_samples": r.get("policy_samples"),
        "policy_velocities_used": sorted({json.dumps(c["velocity"]) for c in r["conversions"] if "velocity" in c}),
    }


MODES = ("colocated", "disaggregated", "disaggregated_convertible")


def sim_side(reqs: list[Request], max_tokens: int, bench_ttft0: float, ttft_x: float, tbt_x: float,
             longest: int) -> dict[str, Any]:
    """The same trace through the simulator (kascade_sim, disaggregated decisions by the operator's policies:
    kascade_sim.pdpolicy): one GPU per instance (llama3-8b on an A800 host), 2 colocated instances vs 1
    prefill + 1 decode, without and with convertible decoders; counts fixed by min = max (as the bench's).
    The trace is time-compressed by k = the bench's unloaded TTFT / the simulator's for the longest prompt,
    so a burst asks the simulated prefiller for the same multiple of its velocity as the real one; SLOs by
    the bench's rule from the simulator's own unloaded latencies (TTFT x ttft_x, TBT x tbt_x)."""
    from kascade_sim.hardware import hardware, model
    from kascade_sim.simulator import SimConfig, Simulation
    from kascade_sim.systems import system
    from kascade_sim.workload import Request as SimRequest
    from kascade_sim.workload import Workload

    spec, hw = model("llama3-8b"), hardware("a800", hosts=1, gpus_per_host=2)
    ttft0, tbt0 = spec.cost.prefill_s(longest), spec.cost.decode_s(1, longest)
    k = bench_ttft0 / ttft0
    t0 = reqs[0][0]
    wl = Workload("pd-bench-trace", tuple(SimRequest((t - t0) / k, len(p), max_tokens) for t, p, _ in reqs))
    ttft_slo, tbt_slo = ttft_x * ttft0, tbt_x * tbt0
    out: dict[str, Any] = {"model": "llama3-8b roofline on A800 (simulated), 2 GPUs", "time_compression": k,
                           "ttft_slo_ms": ttft_slo * 1e3, "tbt_slo_ms": tbt_slo * 1e3,
                           "calibration": {"ttft_ms": ttft0 * 1e3, "tbt_ms": tbt0 * 1e3}}
    for mode in MODES:
        n, sim_mode = (2, "colocated") if mode == "colocated" else (1, "disaggregated")
        cfg = SimConfig(mode=sim_mode, min_instances=n, max_instances=n, tick_s=0.25 / k, window_s=1.0 / k,
                        ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo)
        s = Simulation(wl, hw, spec, system("kascade", convertible=mode == "disaggregated_convertible"), cfg)
        r = s.run()
        res: list[Outcome] = [(a, b if b == b else 0.0, max_tokens) for a, b in zip(r.ttft_s, r.tbt_s, strict=True)]
        conv = [c for c in s.policy_calls if c[1] == "conversion" and c[3].changes]  # type: ignore[attr-defined]
        row = summarize({"results": res, "wall_s": r.end_s, "remote_prefills": math.nan, "fallbacks": math.nan,
                         "conversions": [{"t": round(c[0], 3), "reason": c[3].reason} for c in conv]},  # type: ignore[attr-defined]
                        reqs, ttft_slo, tbt_slo)
        row["converted_prefills"] = r.converted_prefills
        row["handbacks"] = r.handbacks
        row["policy_calls"] = len(s.policy_calls)
        out[mode] = row
    return out
