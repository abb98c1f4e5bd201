"""Routing on expected time to first token (kascade_router.firsttoken, balancer.least_ttft / pick_by_ttft):
the rate counts busy time only, the latency comes from unqueued requests, an unmeasured backend borrows the
others' medians, and the rule sends a request where it waits least, not where the claimed share is largest."""

from __future__ import annotations

import random

import pytest

from kascade_router.backends import Backend
from kascade_router.balancer import expected_ttfts, least_ttft, pick_by_ttft
from kascade_router.firsttoken import (
    MIN_SPAN_S,
    MIN_TOKENS,
    FirstTokens,
    Priors,
    estimate,
    expected_ttft,
    priors,
)

NOW = 100.0  # when the tests' backends are asked (after every `_served`)


def _served(ft: FirstTokens, n: int, gap_s: float, latency_s: float, start: float = 0.0) -> float:
    """n requests sent back to back at `start`, their first tokens `latency_s` later and then every `gap_s`."""
    aheads = [ft.sent(start) for _ in range(n)]
    t = start + latency_s
    for i, ahead in enumerate(aheads):
        ft.first(t, t - start, ahead)
        if i + 1 < n:
            t += gap_s
    return t


def test_the_rule() -> None:
    assert expected_ttft(0, 0.7, 4.0) == 0.7
    assert expected_ttft(8, 0.7, 4.0) == pytest.approx(2.7)
    with pytest.raises(ValueError, match="rate_per_s"):
        expected_ttft(1, 0.7, 0.0)
    with pytest.raises(ValueError, match="ahead"):
        expected_ttft(-1, 0.7, 1.0)


def test_rate_counts_busy_time_only_and_latency_comes_from_the_unqueued_request() -> None:
    ft = FirstTokens()
    assert ft.rate_per_s(0.0) is None and ft.latency_s is None
    end = _served(ft, 8, 0.25, 0.6)  # 4 first tokens per busy second
    assert ft.waiting == 0 and ft.rate_per_s(end) == pytest.approx(4.0)
    assert ft.latency_s == pytest.approx(0.6)  # the first one had nothing ahead
    # a long idle stretch, then more: the rate must not be diluted by the idle time
    end = _served(ft, 8, 0.25, 0.6, start=end + 30.0)
    assert ft.rate_per_s(end + 30.0) == pytest.approx(4.0, rel=0.2)


def test_one_batch_of_first_tokens_measures_no_rate_and_a_stall_lowers_it() -> None:
    """One step starts several prompts: their first tokens land together. Over those alone a rate would be
    hundreds per second; it waits for MIN_SPAN_S of busy time. While requests wait and no first token
    comes, the rate falls."""
    ft = FirstTokens()
    aheads = [ft.sent(0.0) for _ in range(8)]
    for i in range(4):
        ft.first(0.6 + 0.001 * i, 0.6, aheads[i])
    assert ft.rate_per_s(0.61) is None  # 4 first tokens in 3 ms: no rate yet
    assert ft.rate_per_s(0.6 + MIN_SPAN_S) == pytest.approx(3 / MIN_SPAN_S)  # still busy (4 wait): 3 per second
    assert ft.rate_per_s(0.6 + 2 * MIN_SPAN_S) == pytest.approx(3 / (2 * MIN_SPAN_S))  # a stall: half that


def test_fewer_first_tokens_than_the_minimum_measure_no_rate() -> None:
    ft = FirstTokens()
    _served(ft, MIN_TOKENS - 1, 0.6, 0.5)
    assert ft.rate_per_s(NOW) is None and ft.latency_s == pytest.approx(0.5)


def test_a_request_that_ends_without_a_first_token_stops_counting_as_ahead() -> None:
    ft = FirstTokens()
    ft.sent(0.0)
    ft.sent(0.0)
    ft.gone(0.5)
    assert ft.waiting == 1
    with pytest.raises(ValueError, match="ttft_s"):
        ft.first(1.0, -0.1, 0)


def test_an_unmeasured_backend_borrows_the_medians_per_unit_of_weight() -> None:
    a, b = FirstTokens(), FirstTokens()
    _served(a, 8, 0.25, 0.6)  # 4/s
    _served(b, 12, 0.125, 0.8)  # 8/s
    p = priors([(a, 1.0), (b, 1.0), (FirstTokens(), 4.0)], NOW)
    assert p.rate_per_weight == pytest.approx(6.0) and p.latency_s == pytest.approx(0.7)
    fresh = FirstTokens()
    for _ in range(12):
        fresh.sent(0.0)
    assert estimate(fresh, 2.0, p, NOW) == pytest.approx(0.7 + 12 / 12.0)  # weight 2: twice the median rate
    assert estimate(fresh, 2.0, Priors(None, None), NOW) is None  # nothing measured anywhere: no estimate


def _backend(pod: str, weight: float, waiting: int, gap_s: float | None, latency_s: float | None) -> Backend:
    b = Backend(pod, f"{pod}:8000", weight)
    if gap_s is not None and latency_s is not None:
        _served(b.first_tokens, 8, gap_s, latency_s)
    for _ in range(waiting):
        b.first_tokens.sent(NOW)
    b.in_flight = waiting
    return b


def test_the_least_expected_wait_wins_where_the_share_rule_picks_the_big_claim() -> None:
    """bench pipe4 after formation: sources with a few requests ahead at 4.4/s, a pipeline head claiming share 4
    that measured 3/s with 6 ahead. (in flight + 1) / weight sends the next request to the head (7/4 < 4);
    its expected TTFT is 0.8 + 6/3 = 2.8 s against a source's 0.6 + 3/4.4 = 1.3 s."""
    sources = [_backend(f"s{i}", 1.0, 3, 1 / 4.4, 0.6) for i in range(2)]
    head = _backend("head", 4.0, 6, 1 / 3, 0.8)
    pool = [*sources, head]
    assert min(pool, key=lambda b: (b.in_flight + 1) / b.weight) is head  # the old rule
    est = expected_ttfts(pool, now=NOW)
    assert est is not None and est[2] == pytest.approx(2.8) and est[0] == pytest.approx(0.6 + 3 / 4.4)
    assert least_ttft(pool, now=NOW) is sources[0]
    rng = random.Random(0)
    assert all(pick_by_ttft(pool, rng, now=NOW) is not head for _ in range(50))  # p2c: the head loses every pairing


def test_a_fresh_head_is_ranked_by_the_sources_priors_and_its_share() -> None:
    sources = [_backend(f"s{i}", 1.0, 8, 0.25, 0.6) for i in range(2)]  # 4/s, 8 ahead: 2.6 s
    head = _backend("head", 4.0, 0, None, None)  # just formed: nothing measured; prior 16/s, 0.6 s
    assert least_ttft([*sources, head], now=NOW) is head
    for _ in range(33):  # 33 ahead: 0.6 + 33/16 = 2.66 s > 2.6 s
        head.first_tokens.sent(NOW)
    assert least_ttft([*sources, head], now=NOW) is sources[0]


def test_with_nothing_measured_the_share_rule_stands() -> None:
    a, b = _backend("a", 1.0, 2, None, None), _backend("b", 4.0, 3, None, None)
    assert expected_ttfts([a, b], now=NOW) is None
    assert least_ttft([a, b]) is b  # (3 + 1) / 4 < (2 + 1) / 1
    assert least_ttft([a, b], weight=lambda x: 1.0) is a  # the caller's weights
    assert least_ttft([]) is None and pick_by_ttft([], random.Random(0)) is None
