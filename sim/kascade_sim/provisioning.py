"""Provisioning arithmetic: demand over sliding windows, one instance's capacity from the engine cost
model, and how many instances each model and role starts with.

Data flow: `Workload` + `ModelSpec` -> per-model demand series (requests/s and tokens/s per tick, over
a window that is never longer than the time elapsed, so the first ticks are not under-estimated) and
`capacity_rps` (requests/s one instance sustains at the trace's mean lengths) -> initial counts (the
first full window for autoscaled systems, the peak or the average for static ones), shrunk in
proportion when they do not fit the cluster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kascade_sim.hardware import ModelSpec
from kascade_sim.workload import Request, Workload


def _amount(r: Request, what: str) -> float:
    if what == "requests":
        return 1.0
    if what == "prefill":
        return r.input_tokens
    if what == "decode":
        return r.output_tokens
    return r.input_tokens + r.output_tokens


def demand_series(wl: Workload, window_s: float, tick_s: float, what: str = "colocated",
                  model: int | None = None) -> list[float]:
    """Demand per second over a sliding window, sampled every tick (policy input). `what`: requests,
    prefill (input tokens), decode (output tokens) or colocated (both). Early ticks divide by the
    time elapsed, not by the whole window."""
    out = []
    reqs = [r for r in wl.requests if model is None or r.model == model]
    lo = hi = 0
    acc = 0.0
    t = tick_s
    end = wl.duration_s + tick_s
    while t <= end + 1e-9:
        while hi < len(reqs) and reqs[hi].arrival_s <= t:
            acc += _amount(reqs[hi], what)
            hi += 1
        while lo < hi and reqs[lo].arrival_s <= t - window_s:
            acc -= _amount(reqs[lo], what)
            lo += 1
        out.append(acc / min(window_s, t))
        t += tick_s
    return out


def mean_lengths(wl: Workload, model: int) -> tuple[float, float]:
    reqs = [r for r in wl.requests if r.model == model]
    if not reqs:
        return 1.0, 1.0
    return sum(r.input_tokens for r in reqs) / len(reqs), sum(r.output_tokens for r in reqs) / len(reqs)


def capacity_rps(spec: ModelSpec, kv_cap: int, role: str, mean_in: float, mean_out: float) -> float:
    """Requests/s one instance sustains when saturated (prefill batches full, decode batches as large
    as KV and the batch limit allow)."""
    c = spec.cost
    per_batch = max(1, math.floor(spec.max_prefill_tokens / max(1.0, mean_in)))
    prefill_s = c.prefill_s(int(per_batch * mean_in)) / per_batch
    b = max(1, min(spec.max_batch, int(kv_cap / max(1.0, mean_in + mean_out))))
    decode_s = c.decode_s(b, int(b * (mean_in + mean_out / 2))) * max(1.0, mean_out - 1) / b
    if role == "prefill":
        return 1.0 / prefill_s
    if role == "decode":
        return 1.0 / decode_s
    return 1.0 / (prefill_s + decode_s)


def fit_counts(wanted: dict[tuple[int, str], int], minimum: int, slots: int) -> dict[tuple[int, str], int]:
    """Shrink the wanted counts in proportion until they fit `slots` instances (each keeps at least
    `minimum`); a ValueError when even the minimums do not fit."""
    floor_total = minimum * len(wanted)
    if floor_total > slots:
        raise ValueError(f"the cluster has room for {slots} instances but {len(wanted)} model/role groups need "
                         f"at least {minimum} each (lower --min-instances, add GPUs or lower --tp)")
    total = sum(wanted.values())
    if total <= slots:
        return dict(wanted)
    extra = {k: max(0, v - minimum) for k, v in wanted.items()}
    room = slots - floor_total
    scale = room / max(1, sum(extra.values()))
    out = {k: minimum + math.floor(e * scale) for k, e in extra.items()}
    left = slots - sum(out.values())
    for k in sorted(extra, key=lambda k: (-(extra[k] * scale - math.floor(extra[k] * scale)), k)):
        if left <= 0:
            break
        if out[k] < wanted[k]:
            out[k] += 1
            left -= 1
    return out


def fit_by_ratio(need: dict[tuple[int, str], float], minimum: int, slots: int,
                 maximum: int) -> dict[tuple[int, str], int]:
    """Static provisioning: `slots` instances split so that the least provisioned group (instances over the
    instances its demand needs) is as well provisioned as it can be - max-min by the demand/capacity ratio. Every
    group gets `minimum` first, none more than `maximum` or than it needs (rounded up); a ValueError when even
    the minimums do not fit."""
    if minimum * len(need) > slots:
        raise ValueError(f"the cluster has room for {slots} instances but {len(need)} model/role groups need "
                         f"at least {minimum} each (lower --min-instances, add GPUs or lower --tp)")
    out = dict.fromkeys(need, minimum)
    cap = {g: min(maximum, max(minimum, math.ceil(n - 1e-9))) for g, n in need.items()}
    left = slots - minimum * len(need)
    while left > 0:
        open_ = [g for g in need if out[g] < cap[g]]
        if not open_:
            break
        g = min(open_, key=lambda g: (out[g] / need[g] if need[g] > 0 else math.inf, g))
        out[g] += 1
        left -= 1
    return out


def pick(series: Sequence[float], how: str, first_full: int) -> float:
    """The demand an initial count is sized for: peak, average, or the first full window."""
    if not series:
        return 0.0
    if how == "peak":
        return max(series)
    if how == "average":
        return sum(series) / len(series)
    return series[min(first_full, len(series) - 1)]
