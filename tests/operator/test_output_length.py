"""Decode demand from arrivals x an output length estimated from recent history (kascade_planner.outputlength):
a burst of requests that have produced no output yet is decode demand the moment it arrives, in the colocated/
decode tokenVelocity policy and in the P:D ratio policy alike; a measured rate above the projection stays."""

from __future__ import annotations

import pytest
from builders import spec

from kascade_operator.decide import RoleInput, decide, decide_roles
from kascade_planner.outputlength import OutputLength, decode_demand
from kascade_planner.policies import MeasuredVelocity, MetricsSnapshot

RECENT = OutputLength(window_tokens=1000.0, window_requests=20.0, total_tokens=9000.0, total_requests=100.0)


def test_the_estimate_is_the_windows_mean_else_the_lifetime_mean() -> None:
    assert RECENT.mean == 50.0 and RECENT.source == "window"
    idle = OutputLength(0.0, 0.0, 9000.0, 100.0)  # nothing finished in the window (a burst after a calm)
    assert idle.mean == 90.0 and idle.source == "lifetime"
    assert OutputLength().mean is None
    assert (RECENT + idle).mean == 50.0  # pooled: tokens and requests add
    assert (OutputLength(100.0, 1.0) + OutputLength(300.0, 3.0)).mean == 100.0  # not the mean of the means (100, 100)
    assert (OutputLength(100.0, 1.0) + OutputLength(900.0, 3.0)).mean == 250.0
    with pytest.raises(ValueError, match="window_requests"):
        OutputLength(1.0, -1.0)


def test_decode_demand_is_the_larger_of_measured_and_projected() -> None:
    burst = decode_demand(measured_tokens_per_s=100.0, requests_per_s=10.0, output_len=50.0)
    assert burst.tokens_per_s == 500.0 and burst.projected_tokens_per_s == 500.0
    assert "max(measured 100, 10.00 req/s x est. 50.0 output tokens)" in burst.reason
    calm = decode_demand(800.0, 2.0, 50.0)  # long requests still decoding: the measured rate is not cut
    assert calm.tokens_per_s == 800.0
    assert decode_demand(100.0, 10.0, None).tokens_per_s == 100.0  # no finished request yet: measured only
    assert dict(burst.metrics) == {"decodeDemandTokensPerSecond": 500.0, "outputTokensPerSecond": 100.0,
                                   "requestsPerSecond": 10.0, "outputLengthEstimate": 50.0}


def test_a_burst_with_no_output_yet_scales_decoders_at_once() -> None:
    """Colocated/decode tokenVelocity: 10 req/s just arrived, only 100 output tok/s generated so far; recent
    requests generated 50 tokens each, one decoder sustains 100 tok/s -> 5 decoders now, not 1."""
    svc = spec("disaggregated", lo=1, hi=8)
    meas = MeasuredVelocity(1000.0, 100.0, 1000.0)
    before = decide(svc, "decode", 1, 1, 8, MetricsSnapshot(0.0, 500.0, 100.0, measured=meas))
    assert before.desired == 1  # no arrival rate / history: the measured output tokens/s only (the old rule)
    snap = MetricsSnapshot(0.0, 500.0, 100.0, measured=meas, requests_per_s=10.0, output_length=RECENT)
    d = decide(svc, "decode", 1, 1, 8, snap)
    assert d.desired == 5
    assert "10.00 req/s x est. 50.0 output tokens" in d.reason
    assert d.metrics["decodeDemandTokensPerSecond"] == 500.0 and d.metrics["outputLengthEstimate"] == 50.0
    colo = decide(spec("colocated", lo=1, hi=8), "colocated", 1, 1, 8, snap)
    assert colo.desired == 5


def test_the_pd_ratio_sizes_decoders_from_the_projected_demand() -> None:
    svc = spec("disaggregated", lo=1, hi=8)
    meas = MeasuredVelocity(1000.0, 100.0, 1000.0)
    pre = MetricsSnapshot(0.0, 500.0, 0.0, measured=meas, requests_per_s=10.0)  # a prefiller finishes nothing
    dec = MetricsSnapshot(0.0, 500.0, 100.0, measured=meas, requests_per_s=10.0, output_length=RECENT)
    rnd = decide_roles(svc, [RoleInput("prefill", 1, 1, 8, pre), RoleInput("decode", 1, 1, 8, dec)], "timer")
    assert dict(rnd.desired) == {"prefill": 1, "decode": 5}  # 500/1000 -> 1; max(100, 10 x 50)/100 -> 5
    d = next(x for x in rnd.decisions if x.role == "decode")
    assert "P:D ratio" in d.reason and "est. 50.0 output tokens" in d.reason
    assert d.metrics["decodeNeed"] == pytest.approx(5.0) and d.metrics["requestsPerSecond"] == 10.0
    old = decide_roles(svc, [RoleInput("prefill", 1, 1, 8, pre),
                             RoleInput("decode", 1, 1, 8, MetricsSnapshot(0.0, 500.0, 100.0, measured=meas))], "timer")
    assert dict(old.desired)["decode"] == 1  # measured output tokens/s only: 100/100 -> 1 (the old rule)


def test_the_engines_metrics_give_arrivals_and_the_output_length_estimate() -> None:
    """The engine's own metrics code (kascade_engine.metrics), scraped twice by the operator's parser: the
    window's arrivals and finished requests' mean output; an aborted request's cut-short output is left out."""
    from prometheus_client import generate_latest

    from kascade_engine.metrics import EngineMetrics
    from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot

    m = EngineMetrics("m")
    for n in (10, 30):  # history before the window: two requests of 10 and 30 tokens
        m.on_request(5)
        m.on_finish("stop", 0.1, n)
    r = RateTracker(window_s=1.0)
    r.update("a", parse_engine_metrics(generate_latest(m.registry).decode(), 0.0))
    for _ in range(4):
        m.on_request(5)  # a burst: 4 requests arrive within the window...
    m.on_finish("length", 0.1, 100)  # ...one request finishes with 100 tokens, one is aborted after 3
    m.on_finish("abort", 0.1, 3)
    load = r.update("a", parse_engine_metrics(generate_latest(m.registry).decode(), 2.0))
    assert load.requests_per_s == 2.0  # 4 arrivals over 2 s
    assert load.output_length == OutputLength(100.0, 1.0, 140.0, 3.0)
    snap = snapshot([load], 2.0)
    assert snap.requests_per_s == 2.0 and snap.decode_demand.tokens_per_s == 200.0  # 2 req/s x 100 tokens
    calm = r.update("a", parse_engine_metrics(generate_latest(m.registry).decode(), 4.0))
    assert calm.output_length is not None and calm.output_length.mean == pytest.approx(140 / 3)  # none in the window
