"""Policies: table-driven decisions and the bounds/last-copy properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kascade_planner.policies import (
    Bounds,
    Bucket,
    MetricsSnapshot,
    ScaleState,
    Threshold,
    TokenVelocity,
    concurrency,
    threshold,
    token_velocity,
)

TV = TokenVelocity(prefill_tokens_per_s=10_000, network_tokens_per_s=8_000)


@pytest.mark.parametrize(("rate", "want"), [(0, 1), (7_999, 1), (8_001, 2), (40_000, 5), (10**7, 10)])
def test_token_velocity_prefillers(rate: float, want: int) -> None:
    d = token_velocity(MetricsSnapshot(0, input_tokens_per_s=rate), ScaleState("prefill", 1, Bounds(1, 10)), TV)
    assert d.desired == want
    assert "min(prefill 10000, network 8000)" in d.reason


def test_token_velocity_decoders_per_bucket_and_convertible() -> None:
    m = MetricsSnapshot(0, buckets=(Bucket(10, 4), Bucket(3, 1), Bucket(1, 2)))
    assert token_velocity(m, ScaleState("decode", 2, Bounds(1, 20)), TV).desired == 6  # 2.5 + 3 + 0.5
    d = token_velocity(MetricsSnapshot(0, input_tokens_per_s=30_000), ScaleState("prefill", 1, Bounds(1, 10)), TV,
                       idle_decoders=5)
    assert d.desired == 4 and dict(d.extra)["convertDecoders"] == 3
    assert "convertible decoder" in d.reason


def test_threshold_up_and_delayed_down() -> None:
    p = Threshold(upper=1000, lower=200, scale_down_delay_s=0.5)
    s = ScaleState("colocated", 2, Bounds(1, 8))
    up = threshold(MetricsSnapshot(0, input_tokens_per_s=2500, output_tokens_per_s=500), s, p)
    assert up.desired == 3 and "> upper" in up.reason
    low = MetricsSnapshot(10.0, input_tokens_per_s=100)
    d1 = threshold(low, s, p)
    assert d1.desired == 2 and d1.state.below_since_s == 10.0
    d2 = threshold(MetricsSnapshot(10.3, input_tokens_per_s=100), d1.state, p)
    assert d2.desired == 2  # 0.3 s < 0.5 s
    d3 = threshold(MetricsSnapshot(10.6, input_tokens_per_s=100), d2.state, p)
    assert d3.desired == 1 and d3.state.below_since_s is None
    # A blip back into bounds resets the timer.
    mid = threshold(MetricsSnapshot(10.4, input_tokens_per_s=500), d2.state, p)
    assert mid.state.below_since_s is None


def test_threshold_scales_up_from_zero_when_traffic_arrives() -> None:
    p = Threshold(upper=1000, lower=200)
    zero = ScaleState("colocated", 0, Bounds(0, 8), host_cached=True)
    assert threshold(MetricsSnapshot(0, input_tokens_per_s=300), zero, p).desired == 1  # below upper, yet needed
    assert threshold(MetricsSnapshot(0, input_tokens_per_s=2500), zero, p).desired == 3
    assert threshold(MetricsSnapshot(0, in_flight=2), zero, Threshold(0.9, 0.2, metric="kvCacheUsage")).desired == 1
    assert threshold(MetricsSnapshot(0), zero, p).desired == 0  # idle and cached: stays at zero


def test_concurrency_and_bad_parameters() -> None:
    assert concurrency(MetricsSnapshot(0, in_flight=17), ScaleState("colocated", 1, Bounds(1, 9)), 4).desired == 5
    with pytest.raises(ValueError, match="lower < upper"):
        Threshold(upper=1, lower=2)
    with pytest.raises(ValueError, match="min <= max"):
        Bounds(3, 2)
    with pytest.raises(ValueError, match="target_per_instance"):
        concurrency(MetricsSnapshot(0), ScaleState("colocated", 1, Bounds(1, 2)), 0)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5), st.integers(1, 12), st.integers(0, 12), st.booleans(),
       st.floats(0, 1e6), st.floats(0, 1e6), st.integers(0, 500), st.sampled_from(["tv", "th", "cc"]))
def test_bounds_and_last_copy_always_hold(lo: int, span: int, current: int, cached: bool, tin: float, tout: float,
                                          inflight: int, policy: str) -> None:
    b = Bounds(lo, lo + span)
    s = ScaleState("prefill" if policy == "tv" else "colocated", current, b, host_cached=cached)
    m = MetricsSnapshot(1.0, tin, tout, inflight, buckets=(Bucket(tin / 1000, 3),))
    if policy == "tv":
        d = token_velocity(m, s, TV)
    elif policy == "th":
        d = threshold(m, s, Threshold(upper=5000, lower=100, scale_down_delay_s=0))
    else:
        d = concurrency(m, s, 8)
    assert b.min <= d.desired <= b.max or (d.desired == 1 and b.min == 0)
    assert d.desired >= (0 if cached else 1)
