"""Seeded workload generators: BurstGPT-like bursts, square-wave bursts, and a constant load.

Data flow: parameters + seed -> `Workload` (deterministic: `random.Random(seed)`, no global state).

`burstgpt_like` follows the arrival and length models published with BurstGPT (Wang et al., "BurstGPT:
A Real-World Workload Dataset to Optimize LLM Serving Systems", arXiv 2401.17644, §3-4, and its
BurstGPT-Perf generator): request inter-arrival times are Gamma distributed (the paper fits Gamma to
ChatGPT's and GPT-4's inter-arrivals; BurstGPT-Perf's default shape is 0.5, i.e. a coefficient of
variation of sqrt(2), burstier than Poisson), and request/response token counts follow a Zipf law
(BurstGPT-Perf's default exponent 1.1). Beyond one renewal process, the paper's traces show the rate
itself drifting over minutes (its Figure 2); we model that as a rate multiplier per `segment_s`
segment drawn from Gamma(burst_shape, 1/burst_shape) (mean 1). The length ranges are ours, chosen
so the means (~1,000 prompt and ~300 response tokens) sit near those of BurstGPT's ChatGPT rows.
"""

from __future__ import annotations

import math
import random

from kascade_sim.workload import Request, TraceError, Workload


def _zipf(rng: random.Random, a: float, lo: int, hi: int) -> int:
    """Truncated continuous Zipf (power law x^-a on [lo, hi]) by inverse transform, rounded down."""
    u = rng.random()
    if abs(a - 1.0) < 1e-9:
        return int(lo * (hi / lo) ** u)
    e = 1.0 - a
    return min(hi, int((lo ** e + u * (hi ** e - lo ** e)) ** (1.0 / e)))


def burstgpt_like(duration_s: float, rate_rps: float, models: int = 1, seed: int = 0, gamma_shape: float = 0.5,
                  burst_shape: float = 1.0, segment_s: float = 30.0, zipf_a: float = 1.1,
                  prompt_tokens: tuple[int, int] = (16, 8192),
                  response_tokens: tuple[int, int] = (8, 2048)) -> Workload:
    """`rate_rps` requests/s on average per model, each model an independent stream (seed + model)."""
    if not (0 < duration_s <= 30 * 86400) or not (0 < rate_rps <= 1e5) or not 1 <= models <= 1024:
        raise TraceError("burstgpt_like needs 0 < duration <= 30 days, 0 < rate <= 1e5 and 1 <= models <= 1024")
    if not (gamma_shape > 0 and burst_shape > 0 and segment_s > 0 and zipf_a > 0):
        raise TraceError("burstgpt_like needs gamma_shape, burst_shape, segment_s and zipf_a > 0")
    for lo, hi in (prompt_tokens, response_tokens):
        if not 1 <= lo <= hi <= 10_000_000:
            raise TraceError(f"token range must satisfy 1 <= lo <= hi <= 1e7, got {lo}..{hi}")
    if duration_s * rate_rps * models > 50_000_000:
        raise TraceError("burstgpt_like would generate more than 50 million requests")
    out: list[Request] = []
    for m in range(models):
        rng = random.Random(seed * 1_000_003 + m)
        mult = [max(0.05, rng.gammavariate(burst_shape, 1.0 / burst_shape))
                for _ in range(int(duration_s // segment_s) + 1)]
        t = 0.0
        while True:
            lam = rate_rps * mult[int(t // segment_s)]
            t += rng.gammavariate(gamma_shape, 1.0 / (gamma_shape * lam))
            if t >= duration_s:
                break
            out.append(Request(t, _zipf(rng, zipf_a, *prompt_tokens), _zipf(rng, zipf_a, *response_tokens), m))
    out.sort(key=lambda r: (r.arrival_s, r.model))
    return Workload(f"burstgpt-like-{rate_rps:g}rps-{models}m-seed{seed}", tuple(out))


def synthetic_bursts(duration_s: float, base_rps: float, burst_rps: float, burst_every_s: float,
                     burst_len_s: float, input_tokens: int = 1024, output_tokens: int = 128,
                     seed: int = 0) -> Workload:
    """Poisson arrivals at `base_rps`, rising to `burst_rps` for `burst_len_s` every `burst_every_s`;
    lengths are exponential around the given means (seeded, deterministic)."""
    if duration_s <= 0 or base_rps < 0 or burst_rps < 0 or burst_every_s <= 0 or burst_len_s < 0:
        raise TraceError("synthetic bursts need duration > 0, rates >= 0, burst_every > 0, burst_len >= 0")
    rng = random.Random(seed)
    peak = max(base_rps, burst_rps)
    if peak == 0:
        raise TraceError("synthetic bursts need a rate > 0")
    out = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)  # thinning: draw at the peak rate, keep with rate(t)/peak
        if t >= duration_s:
            break
        rate = burst_rps if (t % burst_every_s) < burst_len_s else base_rps
        if rng.random() * peak < rate:
            out.append(Request(t, max(1, int(rng.expovariate(1 / input_tokens))),
                               max(1, int(rng.expovariate(1 / output_tokens)))))
    return Workload(f"bursts-seed{seed}", tuple(out))


def constant(duration_s: float, rate_rps: float, input_tokens: int, output_tokens: int, models: int = 1) -> Workload:
    """Evenly spaced arrivals of identical requests (a load with no variation at all), per model."""
    if not (duration_s > 0 and rate_rps > 0) or input_tokens < 1 or output_tokens < 1 or models < 1:
        raise TraceError("constant load needs duration, rate > 0 and token counts, models >= 1")
    n = math.floor(duration_s * rate_rps)
    reqs = [Request(i / rate_rps, input_tokens, output_tokens, m) for i in range(n) for m in range(models)]
    return Workload(f"constant-{rate_rps:g}rps", tuple(reqs))
