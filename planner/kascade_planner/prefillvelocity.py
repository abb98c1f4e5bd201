"""Prefill velocity: one engine's prefill CAPACITY in prompt tokens/s, as TokenScale defines it (what a prefill
engine sustains when busy), from the per-prompt-length-bucket readings its meter keeps (kascade_engine.batch.velocity).
Pure; the operator reads it from an engine's gauges (kascade_operator.metrics) and the engine's meter answers
with it too, so both mean the same number.

The meter keeps two readings per bucket (the longest prompt in the step):
- capacity: an EWMA of tokens/s over SATURATED steps only, those whose prompt tokens were limited by the step's
  token cap (or a converted decoder's chunk or time budget) while prompt tokens still waited
  (kascade_engine.batch.scheduler.Scheduler.last_saturated). A step that is not full measures the load, not the
  capacity: on an accelerator (flat step time below the knee; bench/pd.py --emulate-layer-ms 30: 240 ms a step
  up to 117 tokens) a 32-token prompt alone in a step reads 133 tok/s while the same engine prefills 488 tok/s
  in a burst (bench/pd.py: the min over buckets read 128 and converted twice before the burst, 46-token chunks).
- floor: the best tokens/s one unsaturated prefill-only step achieved (a max, not an EWMA): a throughput the
  engine really delivered, so a lower bound on its capacity. Never scaled up to a full step: where step time grows
  with tokens (a GPU past its knee, a CPU) that extrapolation over-reads, many times for a short prompt (32 tokens
  in 240 ms scaled to a 512-token budget says 2133 tok/s where a 117-token knee allows 488). Mixed steps give no
  floor: their prefill share is an estimate (the decodes' EWMA subtracted), and a max would keep its worst error.

The rule (`prefill_velocity`):
- any bucket with a capacity: the MIN over those buckets. Kept from the old rule, deliberately: without the demand
  split by length (below), a bucket of longer prompts sustains fewer tokens/s (on the CPU and on a GPU past the
  knee each token attends to more keys), so the slowest saturated bucket is the one a burst of long prompts meets;
  sizing by it keeps up whichever mix comes. The earlier under-read was not the min but unsaturated
  buckets inside it;
- none yet: the MAX over the buckets' floors (the best demonstrated throughput; it only rises as steps fill up, and
  the first saturated step replaces it);
- nothing: None (the policies hold: "no velocity measured").
The demand-weighted rule (`demand_weighted`): with the prompt tokens/s arriving per prompt-length bucket
(kascade_prompt_tokens_arrived_total{bucket}, the same buckets, counted by each request's prompt length), the
velocity is v_eff = sum_b d_b / sum_b (d_b / v_b): the tokens/s the engine sustains on THAT mix, so prefill need
= demand / v_eff = sum_b d_b / v_b (each bucket's prompt tokens at its own capacity). Short prompts on a fast
short bucket no longer pay the long bucket's velocity. A bucket with demand but no capacity of its own counts at
the rule above (the min: it may be as slow as the slowest; no capacity at all: the floor); no demand (an idle
window, an engine that does not count by bucket) gives the rule above exactly. kascade_operator.metrics
.snapshot applies it, so the P:D ratio, tokenVelocity and the conversion policy read the one velocity as before.
The conversion policy takes the capacity alone (`prefill_capacity`; kascade_operator.pdscaling.conversion_input):
a deficit measured against a lower bound is not a deficit, and a real one queues prompts at the prefiller, whose
next step is then saturated and measures the capacity. Against its floor the operator converted a decoder at the
first background prompt and sized the burst's chunks from the floor (bench/pd.py: 83 tok/s at
0.59 s, chunk 72 at the burst where the capacity gave 175).
The simulator's velocity (kascade_sim.pdpolicy.velocities: a full prefill batch's tokens/s from its cost model) is
this rule's capacity: a saturated step's reading, known there from the start, where an engine has only its floor
until its first saturated step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def prefill_capacity(capacity: Iterable[float]) -> float | None:
    """The slowest bucket's capacity (values <= 0: not measured); None before any saturated step."""
    cap = [v for v in capacity if v > 0]
    return min(cap) if cap else None


def prefill_velocity(capacity: Iterable[float], floor: Iterable[float] = ()) -> float | None:
    """One engine's prefill velocity from its buckets' capacities and floors (values <= 0: not measured)."""
    cap = prefill_capacity(capacity)
    if cap is not None:
        return cap
    low = [v for v in floor if v > 0]
    return max(low) if low else None


def demand_weighted(capacity: Mapping[str, float], demand: Mapping[str, float],
                    fallback: float | None) -> float | None:
    """sum_b d_b / sum_b (d_b / v_b) over the buckets with demand (`demand`: prompt tokens/s per bucket; values
    <= 0: none); a bucket with no capacity (<= 0 or absent) counts at `fallback`, the one-velocity rule's answer
    (`prefill_velocity` or `prefill_capacity`), which is also the answer with no demand. None when `fallback` is
    None (no capacity and no floor in any bucket: nothing to weight)."""
    if fallback is None:
        return None
    if not fallback > 0:
        raise ValueError(f"fallback velocity must be > 0 or None, got {fallback}")
    want = {b: d for b, d in demand.items() if d > 0}
    if not want:
        return fallback
    seconds = sum(d / (capacity[b] if capacity.get(b, 0.0) > 0 else fallback) for b, d in want.items())
    return sum(want.values()) / seconds
