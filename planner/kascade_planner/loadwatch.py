"""A load-band long-poll of an engine's `/metrics`, typed once for both ends: the operator holds one per
serving engine and the engine answers it the moment its prompt tokens/s leaves the band, so a crossing is
seen within a tick instead of up to one metric-sweep interval later (the sweep stays as the resync).

Wire: `GET /metrics?above=A&below=B&window=W&wait=S` (`LoadWatch.to_query` / `LoadWatch.from_query`, an
error names the field). The engine holds the request until its prompt tokens/s over the last `W` seconds is
above `A` or below `B`, or `S` seconds pass, then answers exactly as a plain `GET /metrics` (the operator
parses the answer on the same path as a sweep's scrape). A plain `GET /metrics` (no query) answers at once.

Data flow, engine side: `WindowRate.add(t, prompt_tokens_total)` every `TICK_S` while a watch is held ->
`WindowRate.rate(window)` -> `LoadWatch.left(rate)`. Operator side (kascade_operator.loadwatch):
`band_around(last reading)` -> `LoadWatch` -> the held GET -> a scrape of the engine's group -> a round
when its loads changed. Pure stdlib.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

TICK_S = 0.02  # how often a held watch samples the counter: the delay it adds to a crossing
BAND_FRACTION = 0.25  # the band around the last reading: +-25% of its tokens/s ...
BAND_MIN_TPS = 100.0  # ... and at least +-100 tokens/s (an idle engine's trickle does not wake a round)
MAX_WAIT_S = 300.0


@dataclass(frozen=True)
class LoadWatch:
    """Answer when prompt tokens/s over `window_s` is > `above` or < `below`, or after `wait_s`."""

    above: float
    below: float
    window_s: float
    wait_s: float

    def __post_init__(self) -> None:
        for name, v in (("above", self.above), ("below", self.below)):
            if not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number of tokens/s, got {v!r}")
        if self.below > self.above:
            raise ValueError(f"below: {self.below} is above 'above' ({self.above}): the band is empty")
        if not 0 < self.window_s <= 60:
            raise ValueError(f"window: must be in (0, 60] seconds, got {self.window_s!r}")
        if not 0 < self.wait_s <= MAX_WAIT_S:
            raise ValueError(f"wait: must be in (0, {MAX_WAIT_S:g}] seconds, got {self.wait_s!r}")

    def left(self, rate: float | None) -> bool:
        """Whether `rate` (None: not measurable yet) is out of the band."""
        return rate is not None and (rate > self.above or rate < self.below)

    def to_query(self) -> str:
        return f"above={self.above:.3f}&below={self.below:.3f}&window={self.window_s:g}&wait={self.wait_s:g}"

    @staticmethod
    def from_query(q: Mapping[str, str]) -> LoadWatch | None:
        """The watch a `/metrics` query asks for; None for a plain scrape (no `wait`). ValueError names the field."""
        if "wait" not in q:
            return None
        vals: dict[str, float] = {}
        for name in ("above", "below", "window", "wait"):
            if name not in q:
                raise ValueError(f"{name}: required with wait")
            try:
                vals[name] = float(q[name])
            except ValueError:
                raise ValueError(f"{name}: not a number: {q[name]!r}") from None
        return LoadWatch(vals["above"], vals["below"], vals["window"], vals["wait"])


def band_around(tps: float, window_s: float, wait_s: float) -> LoadWatch:
    """The watch that answers when tokens/s moves materially away from `tps` (the last reading)."""
    half = max(BAND_FRACTION * tps, BAND_MIN_TPS)
    return LoadWatch(tps + half, tps - half, window_s, wait_s)


class WindowRate:
    """Counter samples of the last `keep_s` seconds -> the rate over a window (base: the newest sample at least
    the window old, as the operator's RateTracker; the oldest kept when none is). A counter that went down
    (restart) starts over."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self._s: deque[tuple[float, float]] = deque()

    def add(self, t: float, total: float) -> None:
        if self._s and total < self._s[-1][1]:
            self._s.clear()
        if self._s and t <= self._s[-1][0]:
            return
        self._s.append((t, total))
        while len(self._s) >= 2 and self._s[1][0] <= t - self.keep_s:
            self._s.popleft()

    def rate(self, window_s: float) -> float | None:
        """Tokens/s from the base sample to the newest; None with fewer than two samples."""
        if len(self._s) < 2:
            return None
        t, n = self._s[-1]
        base = next((s for s in reversed(self._s) if s[0] <= t - window_s), self._s[0])
        return (n - base[1]) / (t - base[0]) if t > base[0] else None
