"""Expected time to first token per backend, from what the router measures of its own requests.

Concept: a request sent to backend b now gets its first token once the requests b is already prefilling for
this router (sent, no first token yet) have theirs, at the rate b gives first tokens while it has some to
give, plus b's own round trip with nothing of ours ahead:

    expected_ttft = latency_s + ahead / rate_per_s

Why (ADR 0009): (in flight + 1) / weight ranks engines by the capacity they
claim. The head of a λScale pipeline claims its receivers' (serving share 4 in bench pipe4), so it took every
arrival for 1.5-2 s after the pipeline formed and its TTFT climbed from 1.5 to 2.4 s while the sources, their
backlog gone, answered in 1.25 s. Its first token also pays a round trip through every member (0.8 s against
a source's 0.6 s). Measured start rates and latencies, not claimed shares, say where a request waits least.

Measured per backend (`FirstTokens`, fed by whoever sees a request's first token: the bench driver; the proxy,
kascade_router.proxy, through one `Waiting` per request):
- rate: first tokens per second of busy time, a clock that runs only while the backend has at least one of our
  requests waiting for its first token (idle time never dilutes it), from its first token in the last
  RATE_SPAN_S of busy time to now (a stall while busy lowers it), or from its MIN_TOKENS-th last when fewer
  came in that span (a backend slower than MIN_TOKENS first tokens per RATE_SPAN_S never had a rate: a 2 s
  prefill engine took half the prompts under load), and only once that spans MIN_SPAN_S: first
  tokens come in batches (one step starts several prompts), and a rate over a few of one batch's was 100x too
  high (bench pipe4: a source measured that way took every request for a second, TTFT 7 s);
- latency: the TTFT of requests sent while nothing of ours was ahead there (moving average), lowered by any
  faster TTFT seen (every TTFT bounds it from above).
A backend we have left idle for STALE_S (nothing of ours waiting, no first token since) is measured afresh:
what it measured then (its batch, its load from other routers, its role: a pipeline member since became a
replica) is no longer evidence, and without this a backend once measured slow would be sent requests only when
the others' queues made its old estimate competitive. It counts as unmeasured (priors) until measured again.
With nothing of ours waiting there the expected TTFT is its latency, rate or not (nothing is ahead to divide).
A backend with no measurement yet gets priors from the others (`Priors`): rate = its weight x the median rate
per unit of weight of the measured ones, latency = their median latency. With no measurement anywhere there
is no estimate (None), and the caller ranks by (in flight + 1) / weight as before.

Data flow: request sent -> `FirstTokens.sent` (its `ahead`; `Waiting` keeps it with the time sent) -> first
token -> `first(now, ttft, ahead)` (or `gone` if it ended without one) -> `priors` over the candidates -> `estimate`
per candidate -> the balancer
picks the least (kascade_router.balancer.pick_by_ttft).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

RATE_WINDOW = 64  # first tokens kept for the rate
RATE_SPAN_S = 3.0  # busy seconds the rate looks back (several steps of a busy engine)
MIN_SPAN_S = 1.0  # a rate over less busy time than this is none (more than one batch's worth of first tokens)
MIN_TOKENS = 4  # fewer first tokens than this measure no rate
LATENCY_ALPHA = 0.3  # weight of a new unqueued TTFT in the latency's moving average
STALE_S = 15.0  # a backend idle for us this long (nothing waiting, no first token) is measured afresh


def expected_ttft(ahead: int, latency_s: float, rate_per_s: float) -> float:
    """The rule: the round trip plus the time the requests ahead take to get their first tokens."""
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    return latency_s + ahead / rate_per_s


@dataclass
class FirstTokens:
    """One backend's first tokens as this router saw them (times on any one monotonic clock)."""

    waiting: int = 0  # our requests sent there with no first token yet
    busy_s: float = 0.0  # the busy clock: time with waiting > 0
    latency_s: float | None = None
    _at: float | None = None  # time of the last event
    _last_first: float | None = None  # time of the last first token
    _tokens: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))  # busy clock at each first token

    def busy_at(self, now: float) -> float:
        """The busy clock at `now` (it runs on while our requests wait)."""
        if self._at is not None and self.waiting > 0:
            return self.busy_s + max(0.0, now - self._at)
        return self.busy_s

    def _advance(self, now: float) -> None:
        if self._at is not None and self.waiting > 0:
            self.busy_s += max(0.0, now - self._at)
        self._at = now if self._at is None else max(self._at, now)

    def stale(self, now: float) -> bool:
        """Idle for us (nothing waiting) since a first token more than STALE_S ago: its measurements say nothing."""
        return self.waiting == 0 and self._last_first is not None and now - self._last_first > STALE_S

    def sent(self, now: float) -> int:
        """A request goes there now; returns how many of ours wait ahead of it (pass it to `first`)."""
        if self.stale(now):
            self._tokens.clear()
            self.latency_s = self._last_first = None
        self._advance(now)
        ahead = self.waiting
        self.waiting += 1
        return ahead

    def first(self, now: float, ttft_s: float, ahead: int) -> None:
        """Its first token came `ttft_s` after it was sent, `ahead` of ours were waiting when it was."""
        if ttft_s < 0 or ahead < 0:
            raise ValueError(f"ttft_s and ahead must be >= 0, got {ttft_s} and {ahead}")
        self._advance(now)
        self.waiting = max(0, self.waiting - 1)
        self._tokens.append(self.busy_s)
        self._last_first = now
        if ahead == 0:
            self.latency_s = (
                ttft_s if self.latency_s is None else ((1 - LATENCY_ALPHA) * self.latency_s + LATENCY_ALPHA * ttft_s)
            )
        if self.latency_s is not None and ttft_s < self.latency_s:
            self.latency_s = ttft_s  # any TTFT bounds the round trip from above

    def latency(self, now: float) -> float | None:
        """The round trip with nothing of ours ahead; None unmeasured or stale."""
        return None if self.stale(now) else self.latency_s

    def gone(self, now: float) -> None:
        """A request sent there ended without a first token (failed, aborted, not streamed)."""
        self._advance(now)
        self.waiting = max(0, self.waiting - 1)

    def rate_per_s(self, now: float) -> float | None:
        """First tokens per second of busy time, from the first of them in the last RATE_SPAN_S busy seconds (or the
        MIN_TOKENS-th last, when fewer came in that span) to now; None with fewer than MIN_TOKENS first tokens or
        less than MIN_SPAN_S of busy time since the first counted."""
        if self.stale(now):
            return None
        busy = self.busy_at(now)
        if len(self._tokens) < MIN_TOKENS:
            return None
        recent = [b for b in self._tokens if b >= busy - RATE_SPAN_S]
        if len(recent) < MIN_TOKENS:  # a slow backend: its last MIN_TOKENS, however much busy time they took
            recent = list(self._tokens)[-MIN_TOKENS:]
        span = busy - recent[0]
        return (len(recent) - 1) / span if span >= MIN_SPAN_S else None


class Waiting:
    """One request waiting for its first token at one backend: sent on creation, then `first` or `gone`, once
    (later calls do nothing), so every exit path of a request can end it without counting it twice."""

    def __init__(self, ft: FirstTokens, now: float) -> None:
        self.ft, self.sent_at = ft, now
        self.ahead = ft.sent(now)
        self.open = True

    def first(self, now: float) -> None:
        """Its first token arrived at `now`."""
        if self.open:
            self.open = False
            self.ft.first(now, max(0.0, now - self.sent_at), self.ahead)

    def gone(self, now: float) -> None:
        """It ended (failed, retried elsewhere, handed to another engine) without a first token here."""
        if self.open:
            self.open = False
            self.ft.gone(now)


@dataclass(frozen=True)
class Priors:
    """What an unmeasured backend is assumed to do: the measured ones' medians."""

    rate_per_weight: float | None
    latency_s: float | None


def priors(measured: Iterable[tuple[FirstTokens, float]], now: float) -> Priors:
    """From (first tokens, weight) of the candidates: the median rate per unit of weight of those with a rate,
    the median latency of those with one (None where none has)."""
    rates, lats = [], []
    for ft, weight in measured:
        r = ft.rate_per_s(now)
        if r is not None and weight > 0:
            rates.append(r / weight)
        if (lat := ft.latency(now)) is not None:
            lats.append(lat)
    return Priors(statistics.median(rates) if rates else None, statistics.median(lats) if lats else None)


def estimate(ft: FirstTokens, weight: float, prior: Priors, now: float) -> float | None:
    """The expected TTFT of one more request there, measured where it can be, from `prior` where not; None
    when neither gives a latency, or nothing gives a rate while requests of ours wait there."""
    latency = ft.latency(now)
    latency = latency if latency is not None else prior.latency_s
    if ft.waiting == 0:  # nothing ahead: the rate does not enter (sequential requests measure no rate for long)
        return latency
    rate = ft.rate_per_s(now)
    if rate is None and prior.rate_per_weight is not None and weight > 0:
        rate = prior.rate_per_weight * weight
    if rate is None or latency is None:
        return None
    return expected_ttft(ft.waiting, latency, rate)
