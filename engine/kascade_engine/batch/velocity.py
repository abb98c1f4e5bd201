"""Velocity: this engine's prefill and decode capacity measured online from its own step timings (TokenScale's
prefill and decode velocities, measured instead of typed into the ModelService). Pure python, no torch.

Data flow: `Engine.step` times each forward and calls `observe(prefill chunks, decodes, seconds, saturated=)`
(`saturated`: the scheduler's `last_saturated`, the step's prompt tokens were limited by its token cap, chunk cap
or time budget while prompt tokens still waited) ->
  prefill: per prompt-length bucket (the longest prompt in the step), the CAPACITY, an EWMA of prompt tokens/s
  over saturated steps only, and the FLOOR, the best tokens/s of one unsaturated prefill-only step (a lower bound:
  what the engine delivered, never scaled up to a full step). A step that is not full measures the load, not the
  capacity: on an accelerator (flat step time below its knee) a short prompt alone in a step reads a quarter of
  what the engine prefills in a burst (bench/pd.py --emulate-layer-ms 30: 128 vs 480 tok/s). On the
  CPU (step time linear in tokens, plus an intercept) the unsaturated reading is lower too, by less;
  decode-only steps: tokens / s, an EWMA per batch-size bucket (a bigger batch decodes more tokens/s);
  mixed steps: the decodes' share is estimated from the decode EWMA of that batch size and the rest of the
  step's time is the prefill's (skipped until a decode velocity is known); counted toward the capacity when
  saturated, never toward the floor (an estimate, and the floor is a max)
-> /metrics: kascade_prefill_velocity_tokens_per_second{bucket} (capacity; 0 = no saturated step yet),
   kascade_prefill_velocity_floor_tokens_per_second{bucket}, kascade_decode_velocity_tokens_per_second{batch}
-> the operator reads one number per engine, `prefill_capacity()`'s rule (kascade_planner.prefillvelocity
   .prefill_velocity: the slowest bucket with a capacity, else the best floor), and each bucket's capacity, which
   it weights by the prompt tokens arriving per bucket (metrics.py's kascade_prompt_tokens_arrived_total{bucket},
   the same `bucket()` of each request's prompt length; prefillvelocity.demand_weighted) for its tokenVelocity and
   P:D ratio policies; its conversion policy takes the capacity alone (no conversion against a floor).

The prefill RATE is another number: the prompt tokens this engine actually prefills per second of step time
while prompts wait to be prefilled (`observe_rate`, every such step, also one that gave them 0 tokens); on a
converted decoder with no prompt waiting, the tokens its budgets would give one beside that step's decodes
(`Scheduler.known_room`, the chunk's predicted time added), so the rate follows its batch between prompts: a
rate measured on one prompt at a small batch was stale when the burst's decodes filled the step (bench/pd.py:
the next prompt got 0 tokens and was handed back). On a
prefill engine it is its prefill velocity. On a converted decoder it is what its chunk and step budgets leave
prompts beside its decodes: on 2 shared CPU cores 7-45 % of a prefill engine's (bench/pd.py),
where the velocity above (the prefill share of a mixed step's time) is about a prefill engine's. Ratio of the
two engines' rates = how much of a prefill engine a converted decoder is (kascade_planner.conversion
.converted_share) -> PREFILL_RATE_HEADER on answers and /readyz (the router's prefill choice) and
kascade_prefill_rate_tokens_per_second (the operator's conversion policy). Reset when the budgets change; a
converted decoder then measures it at once with a warm-up prompt (probe.py). A step whose prompt chunk its step
budget could not cut yet (no prompt token timed: stepcost.StepCost.token_s None) is not counted: it ran under
the token cap alone and reported a rate the budget never gives (Engine.step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kascade_planner.prefillrate import PrefillRate
from kascade_planner.prefillvelocity import prefill_velocity

PROMPT_BUCKETS = (128, 512, 2048)  # prompt length upper bounds; longer prompts fall in "inf"
BATCH_BUCKETS = (1, 4, 16, 64)  # decode batch upper bounds; bigger batches fall in "inf"
ALPHA = 0.2  # EWMA weight of the newest step


def bucket(value: int, bounds: tuple[int, ...]) -> str:
    for b in bounds:
        if value <= b:
            return str(b)
    return "inf"


@dataclass
class VelocityMeter:
    prefill: dict[str, float] = field(default_factory=dict)  # prompt bucket -> prompt tokens/s of saturated steps
    prefill_floor: dict[str, float] = field(default_factory=dict)  # prompt bucket -> best unsaturated step's tokens/s
    decode: dict[str, float] = field(default_factory=dict)  # batch bucket -> generated tokens/s
    steps: int = 0
    # the prefill rate over steps taken while prompts waited to prefill (the simulator's meter too)
    rate: PrefillRate = field(default_factory=PrefillRate)

    @staticmethod
    def _ewma(table: dict[str, float], key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - ALPHA) * old + ALPHA * value

    def observe(self, prefill: list[tuple[int, int]], decodes: int, seconds: float, *, saturated: bool) -> None:
        """One step: `prefill` (chunk tokens, prompt length) per prefill chunk, `decodes` decode rows; `saturated`:
        its prompt tokens were limited by its token cap or budget while prompt tokens still waited."""
        if seconds <= 0 or (not prefill and not decodes):
            return
        self.steps += 1
        tokens = sum(n for n, _ in prefill)
        if not prefill:
            self._ewma(self.decode, bucket(decodes, BATCH_BUCKETS), decodes / seconds)
            return
        key = bucket(max(p for _, p in prefill), PROMPT_BUCKETS)
        if not decodes:
            if saturated:
                self._ewma(self.prefill, key, tokens / seconds)
            else:  # what this step delivered: a lower bound on the capacity, kept at its best
                self.prefill_floor[key] = max(self.prefill_floor.get(key, 0.0), tokens / seconds)
            return
        if not saturated:
            return  # a mixed step that is not full: its prefill share is an estimate of the load, not the capacity
        v = self.decode.get(bucket(decodes, BATCH_BUCKETS))
        if v is None:
            return  # cannot split the step's time yet
        left = seconds - decodes / v
        if left > 0.1 * seconds:  # the decode estimate left the prefill a meaningful share
            self._ewma(self.prefill, key, tokens / left)

    def observe_rate(self, tokens: int, seconds: float) -> None:
        """One step taken while prompts waited to be prefilled: `tokens` prompt tokens it prefilled (0 too)."""
        self.rate.observe(tokens, seconds)

    def prefill_rate(self) -> float | None:
        """Prompt tokens/s this engine gave waiting prompts over its recent steps; None until it saw a few."""
        return self.rate.rate()

    def reset_rate(self) -> None:
        """Forget the prefill rate: the budgets it was measured under changed (a decoder converted or taken back)."""
        self.rate.reset()

    def prefill_capacity(self) -> float | None:
        """This engine's prefill velocity as the operator reads it from /metrics: the slowest bucket's capacity,
        the best floor before any saturated step, None before any prefill (kascade_planner.prefillvelocity)."""
        return prefill_velocity(self.prefill.values(), self.prefill_floor.values())

    def prefill_velocity(self, prompt_len: int) -> float | None:
        """Prompt tokens/s (capacity) for prompts of this length (the nearest bucket with a capacity when this one
        has none; None before any saturated step)."""
        if not self.prefill:
            return None
        want = bucket(prompt_len, PROMPT_BUCKETS)
        if want in self.prefill:
            return self.prefill[want]
        order = [str(b) for b in PROMPT_BUCKETS] + ["inf"]
        i = order.index(want)
        return self.prefill[min(self.prefill, key=lambda k: abs(order.index(k) - i))]

    def decode_capacity(self) -> float | None:
        """Tokens/s at the largest batch measured so far (what one decoder sustains when full)."""
        return max(self.decode.values()) if self.decode else None
