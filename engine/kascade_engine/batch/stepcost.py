"""Step cost: this engine's step time as a linear function of what the step runs, fitted online from its own
step timings, so a converted decoder can budget its prefill chunks in TIME (the TBT objective) rather than
in tokens. Pure python, no torch.

Why a model of the whole step, not a tokens/s velocity: on this engine a step's time is mostly (1) the
weights, read once whatever the rows (an intercept), (2) the rows through the linear layers, and (3) the K/V
the attention gathers: every key of every sequence in the step, padded to the longest context of its group
(kvcache.build_batch). Measured (bench/pd.py): a decode-only step of 1 sequence at 60 keys takes
9 ms, at 380 keys 17 ms, 20 sequences at ~400 keys 85 ms; a 16-token chunk adds 11-25 ms, more with a bigger
batch. A token budget sized from a prefill velocity sees none of that.

Features of a step (`StepShape`): decode rows, prompt tokens, and gathered keys (decode group: decodes x their
longest context; prefill group: chunks x their longest context end). The fit is recursive least squares with
forgetting (`FORGET`: about the last 100 steps weigh), so it follows the machine as load moves.

Data flow: `Engine.step` -> `observe(shape, seconds)` for every forward -> `Scheduler.schedule` asks
`chunk_fits(budget_s, shape so far, start, n)`: the most prompt tokens of a chunk starting at `start` the
step can take and still be predicted within `budget_s` (None while no prompt token has been timed yet, so
the caller keeps its token cap alone) -> /metrics shows the fitted costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FORGET = 0.99  # RLS forgetting factor per step
KEYS_UNIT = 1000.0  # gathered keys are fed in thousands: features of similar size keep the fit well conditioned
PRIOR = 1e4  # initial variance of every coefficient (nothing known)
MIN_TOKEN_S = 1e-6  # a prompt token never costs less than this (a noisy fit can go to zero or below)
TIMED_STEPS = 3  # steps with prompt tokens seen before the prompt-token cost is trusted


@dataclass(frozen=True)
class StepShape:
    """What one step runs, as its cost sees it."""

    decodes: int = 0  # decode rows (one token each)
    decode_key_max: int = 0  # the longest decode context (the decode group gathers decodes x this)
    prompt_tokens: int = 0  # prefill chunk tokens
    prefill_seqs: int = 0
    prefill_key_max: int = 0  # the longest chunk end (the prefill group gathers prefill_seqs x this)

    def __post_init__(self) -> None:
        if min(self.decodes, self.decode_key_max, self.prompt_tokens, self.prefill_seqs, self.prefill_key_max) >= 0:
            return  # one call per shape (a step makes a few): the named check below only when one is negative
        for name in ("decodes", "decode_key_max", "prompt_tokens", "prefill_seqs", "prefill_key_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"step shape field {name} must be >= 0, got {getattr(self, name)}")

    def features(self) -> tuple[float, float, float, float]:
        keys = self.decodes * self.decode_key_max + self.prefill_seqs * self.prefill_key_max
        return 1.0, float(self.decodes), float(self.prompt_tokens), keys / KEYS_UNIT

    def with_decode(self, keys: int) -> StepShape:
        """This shape plus a decode that attends to `keys` positions."""
        return StepShape(self.decodes + 1, max(self.decode_key_max, keys), self.prompt_tokens, self.prefill_seqs,
                         self.prefill_key_max)

    def with_decodes(self, count: int, keys: int) -> StepShape:
        """This shape plus `count` decodes, the longest attending to `keys` positions (one object for a batch)."""
        if not count:
            return self
        return StepShape(self.decodes + count, max(self.decode_key_max, keys), self.prompt_tokens, self.prefill_seqs,
                         self.prefill_key_max)

    def with_chunk(self, start: int, n: int) -> StepShape:
        """This shape plus a prefill chunk of `n` tokens from position `start`."""
        return StepShape(self.decodes, self.decode_key_max, self.prompt_tokens + n, self.prefill_seqs + 1,
                         max(self.prefill_key_max, start + n))

    @staticmethod
    def of(work: list[tuple[int, int]]) -> StepShape:
        """From a step's (start, n) per sequence: n == 1 a decode, n > 1 a prompt chunk."""
        dec = [s + n for s, n in work if n == 1]
        pre = [(s, n) for s, n in work if n > 1]
        if not pre:
            return StepShape(len(dec), max(dec, default=0))
        return StepShape(len(dec), max(dec, default=0), sum([n for _, n in pre]), len(pre),
                         max([s + n for s, n in pre]))


@dataclass
class StepCost:
    theta: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # seconds per feature
    cov: list[list[float]] = field(default_factory=lambda: [[PRIOR if i == j else 0.0 for j in range(4)]
                                                            for i in range(4)])
    steps: int = 0
    prompt_steps: int = 0  # steps that prefilled prompt tokens

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step's measured time: a recursive least squares update with forgetting."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        x0, x1, x2, x3 = shape.features()  # written out (4 features): once per step, on the step's thread
        px = [r[0] * x0 + r[1] * x1 + r[2] * x2 + r[3] * x3 for r in self.cov]
        p0, p1, p2, p3 = px
        denom = FORGET + (x0 * p0 + x1 * p1 + x2 * p2 + x3 * p3)
        gain = [p / denom for p in px]
        t = self.theta
        err = seconds - (t[0] * x0 + t[1] * x1 + t[2] * x2 + t[3] * x3)
        self.theta = [a + g * err for a, g in zip(t, gain, strict=True)]
        self.cov = [[(r[0] - g * p0) / FORGET, (r[1] - g * p1) / FORGET, (r[2] - g * p2) / FORGET,
                     (r[3] - g * p3) / FORGET] for r, g in zip(self.cov, gain, strict=True)]
        self.steps += 1
        self.prompt_steps += shape.prompt_tokens > 0

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds; rows and keys never cost less than nothing (a noisy fit's negative slope is read
        as 0, a prompt token as MIN_TOKEN_S), so the prediction grows with every feature."""
        x = shape.features()
        floors = (0.0, MIN_TOKEN_S, 0.0)
        return self.theta[0] + sum(max(t, lo) * f for t, lo, f in zip(self.theta[1:], floors, x[1:], strict=True))

    @property
    def token_s(self) -> float | None:
        """Seconds one more prompt token adds to a step (its rows; not its keys); None until timed."""
        if self.prompt_steps < TIMED_STEPS:
            return None
        return max(self.theta[2], MIN_TOKEN_S)

    def chunk_fits(self, budget_s: float, shape: StepShape, start: int, n: int) -> int | None:
        """The most of an `n`-token chunk from `start` a step of `shape` can add while predicted within
        `budget_s` (0: none; n: all of it); None while the prompt-token cost is not measured yet."""
        per = self.token_s
        if per is None:
            return None
        if n <= 0 or self.predict(shape.with_chunk(start, 1)) > budget_s:
            return 0
        lo, hi = 1, n  # the prediction grows with n (rows, keys past the longest end): the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(shape.with_chunk(start, mid)) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
