"""Token velocity measured, not typed: the engine's velocity gauges (rendered by the engine's own metrics
code) are read by the operator's scrape parser, averaged per role, and drive the tokenVelocity policy
when the ModelService types no velocities; typed ones still win."""

from __future__ import annotations

from builders import spec
from prometheus_client import CollectorRegistry, generate_latest

from kascade_engine.batch.velocity import VelocityMeter
from kascade_engine.pd.metrics import PDMetrics
from kascade_operator.decide import decide
from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot
from kascade_planner.policies import MeasuredVelocity, MetricsSnapshot


def _engine_text(prefill: dict[str, float], decode: dict[str, float], link_tps: float | None,
                 floor: dict[str, float] | None = None) -> str:
    reg = CollectorRegistry()
    pd = PDMetrics(reg, "m")
    meter = VelocityMeter(prefill=dict(prefill), prefill_floor=dict(floor or {}), decode=dict(decode))
    pd.export_velocity(reg, lambda: meter)
    if link_tps is not None:
        pd.link("10.0.0.1:9000", link_tps * 1000, link_tps)
    return generate_latest(reg).decode()


def test_operator_reads_the_engines_velocity_gauges() -> None:
    s = parse_engine_metrics(_engine_text({"128": 900.0, "512": 600.0}, {"1": 20.0, "16": 150.0}, 4000.0), 1.0)
    # slowest prompt bucket (and each bucket's capacity), best batch, link
    assert s.velocity == MeasuredVelocity(600.0, 150.0, 4000.0, None, 600.0, (("128", 900.0), ("512", 600.0)))
    # capacities (saturated steps) win over floors; with none, the best floor (kascade_planner.prefillvelocity)
    both = parse_engine_metrics(_engine_text({"512": 480.0}, {}, None, floor={"128": 130.0, "512": 700.0}), 1.0)
    assert both.velocity == MeasuredVelocity(480.0, prefill_capacity_tokens_per_s=480.0,
                                             prefill_buckets=(("512", 480.0),))
    floors = parse_engine_metrics(_engine_text({}, {}, None, floor={"128": 130.0, "512": 200.0}), 1.0)
    assert floors.velocity == MeasuredVelocity(200.0)  # no capacity: the conversion policy holds (pdscaling)
    assert parse_engine_metrics(_engine_text({}, {}, None), 1.0).velocity is None  # all 0: not measured yet
    r = RateTracker()
    loads = [r.update("a", s), r.update("b", parse_engine_metrics(_engine_text({"128": 400.0}, {}, None), 1.0))]
    snap = snapshot(loads, 1.0)
    # per instance, averaged (bucket capacities per bucket, over the instances that have the bucket)
    assert snap.measured == MeasuredVelocity(500.0, 150.0, 4000.0, None, 500.0, (("128", 650.0), ("512", 600.0)))


def test_token_velocity_policy_uses_measured_velocities_when_none_are_typed() -> None:
    svc = spec("disaggregated", lo=1, hi=8)  # policy tokenVelocity, no velocities typed
    snap = MetricsSnapshot(0.0, input_tokens_per_s=2500, output_tokens_per_s=450,
                           measured=MeasuredVelocity(1000.0, 100.0, 800.0))
    p = decide(svc, "prefill", 1, 1, 8, snap)
    assert p.desired == 4  # 2500 / min(prefill 1000, network 800) = 3.1 -> 4
    assert "measured velocities" in p.reason and "network 800" in p.reason
    d = decide(svc, "decode", 1, 1, 8, snap)
    assert d.desired == 5 and "measured" in d.reason  # 450 / 100 = 4.5 -> 5
    held = decide(svc, "prefill", 2, 1, 8, MetricsSnapshot(0.0, input_tokens_per_s=2500))
    assert held.desired == 2 and "no velocities configured or measured" in held.reason
    typed = spec("disaggregated", lo=1, hi=8, scaling={"tokenVelocity": {"prefillTokensPerSecond": 2500,
                                                                         "networkTokensPerSecond": 2500}})
    t = decide(typed, "prefill", 1, 1, 8, snap)
    assert t.desired == 1 and "measured" not in t.reason  # typed velocities win
