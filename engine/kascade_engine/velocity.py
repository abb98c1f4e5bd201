"""Velocity: this engine's prefill and decode capacity measured online from its own step timings (TokenScale's
prefill and decode velocities, measured instead of typed into the ModelService). Pure python, no torch.

Data flow: `Engine.step` times each forward and calls `observe(prefill chunks, decodes, seconds)` ->
  prefill-only steps: prompt tokens / s, an EWMA per prompt-length bucket (the longest prompt in the step);
  decode-only steps: tokens / s, an EWMA per batch-size bucket (a bigger batch decodes more tokens/s);
  mixed steps: the decodes' share is estimated from the decode EWMA of that batch size and the rest of the
  step's time is the prefill's (skipped until a decode velocity is known)
-> /metrics: kascade_prefill_velocity_tokens_per_second{bucket}, kascade_decode_velocity_tokens_per_second{batch}
-> the operator's tokenVelocity policy reads them (kascade_operator.metrics).

The prefill RATE is another number: the prompt tokens this engine actually prefills per second of step time
while prompts wait to be prefilled (`observe_rate`, every such step, also one that gave them 0 tokens); on a
converted decoder with no prompt waiting, the tokens its budgets would give one beside that step's decodes
(`Scheduler.known_room`, the chunk's predicted time added), so the rate follows its batch between prompts: a
rate measured on one prompt at a small batch was stale when the burst's decodes filled the step (bench/pd.py
2026-11-27-d run 1: the next prompt got 0 tokens and was handed back). On a
prefill engine it is its prefill velocity. On a converted decoder it is what its chunk and step budgets leave
prompts beside its decodes: on 2 shared CPU cores 7-45 % of a prefill engine's (bench/pd.py, 2026-11-27-c),
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
    prefill: dict[str, float] = field(default_factory=dict)  # prompt bucket -> prompt tokens/s
    decode: dict[str, float] = field(default_factory=dict)  # batch bucket -> generated tokens/s
    steps: int = 0
    # the prefill rate over steps taken while prompts waited to prefill (the simulator's meter too)
    rate: PrefillRate = field(default_factory=PrefillRate)

    @staticmethod
    def _ewma(table: dict[str, float], key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - ALPHA) * old + ALPHA * value

    def observe(self, prefill: list[tuple[int, int]], decodes: int, seconds: float) -> None:
        """One step: `prefill` (chunk tokens, prompt length) per prefill chunk, `decodes` decode rows."""
        if seconds <= 0 or (not prefill and not decodes):
            return
        self.steps += 1
        tokens = sum(n for n, _ in prefill)
        if not prefill:
            self._ewma(self.decode, bucket(decodes, BATCH_BUCKETS), decodes / seconds)
            return
        spent = 0.0
        if decodes:
            v = self.decode.get(bucket(decodes, BATCH_BUCKETS))
            if v is None:
                return  # cannot split the step's time yet
            spent = decodes / v
        left = seconds - spent
        if left > 0.1 * seconds:  # the decode estimate left the prefill a meaningful share
            self._ewma(self.prefill, bucket(max(p for _, p in prefill), PROMPT_BUCKETS), tokens / left)

    def observe_rate(self, tokens: int, seconds: float) -> None:
        """One step taken while prompts waited to be prefilled: `tokens` prompt tokens it prefilled (0 too)."""
        self.rate.observe(tokens, seconds)

    def prefill_rate(self) -> float | None:
        """Prompt tokens/s this engine gave waiting prompts over its recent steps; None until it saw a few."""
        return self.rate.rate()

    def reset_rate(self) -> None:
        """Forget the prefill rate: the budgets it was measured under changed (a decoder converted or taken back)."""
        self.rate.reset()

    def prefill_velocity(self, prompt_len: int) -> float | None:
        """Prompt tokens/s for prompts of this length (the nearest measured bucket when this one is not)."""
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
