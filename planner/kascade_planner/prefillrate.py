"""Prefill rate: the prompt tokens an engine actually prefills per second of its step time while prompts wait
to be prefilled. The engine measures it from its own steps (kascade_engine.batch.velocity) and the simulator from its
cost model's steps (kascade_sim.serving), with this one meter, so a converted decoder's share of a prefiller
(`kascade_planner.conversion.converted_share`) means the same in both.

Data flow: every step taken while prompts waited -> `observe(prompt tokens it prefilled, 0 too; step seconds)`
-> EWMAs of tokens and of seconds (a ratio of averages: a step that gave the prompts 0 tokens lowers the rate,
one big chunk does not swing it) -> `rate()`: tokens / seconds once `RATE_STEPS` steps were seen, else None.
`reset()` when the budgets it was measured under change (a decoder converted or taken back).
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # EWMA weight of the newest step
RATE_STEPS = 3  # steps timed while prompts waited before the rate is reported


@dataclass
class PrefillRate:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step taken while prompts waited to be prefilled: `tokens` prompt tokens it prefilled (0 too)."""
        if seconds <= 0 or tokens < 0:
            return
        if self.steps == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens = (1 - ALPHA) * self.tokens + ALPHA * tokens
            self.seconds = (1 - ALPHA) * self.seconds + ALPHA * seconds
        self.steps += 1

    def rate(self) -> float | None:
        """Prompt tokens/s given to waiting prompts over the recent steps; None until `RATE_STEPS` steps."""
        if self.steps < RATE_STEPS or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    def reset(self) -> None:
        self.tokens, self.seconds, self.steps = 0.0, 0.0, 0
