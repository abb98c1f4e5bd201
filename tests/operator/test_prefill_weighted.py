"""The prefill velocity weighted by the prompt tokens arriving per prompt-length bucket
(kascade_planner.prefillvelocity.demand_weighted: v_eff = sum d_b / sum d_b / v_b): short prompts on a fast short
bucket are sized at that bucket's velocity, not the slowest bucket's; a bucket without a capacity counts at the
one-velocity rule; no per-bucket demand (an older engine, an idle window) is exactly the one-velocity rule. The
engine's own metrics code renders the gauges and the counter, the operator's parser, rate tracker and snapshot
weight them, and the Prometheus source gives the same answer."""

from __future__ import annotations

from typing import Any

import pytest
from builders import spec
from prometheus_client import generate_latest
from promfake import prometheus

from kascade_engine.batch.velocity import VelocityMeter
from kascade_engine.metrics import EngineMetrics
from kascade_engine.pd.metrics import PDMetrics
from kascade_operator.decide import decide
from kascade_operator.metrics import PrometheusSource, RateTracker, parse_engine_metrics, snapshot
from kascade_planner.policies import MeasuredVelocity
from kascade_planner.prefillvelocity import demand_weighted, prefill_velocity

FAST_SHORT, SLOW_LONG = {"128": 1200.0}, {"2048": 300.0}
CAPS = {**FAST_SHORT, **SLOW_LONG}


def test_short_prompt_demand_gets_a_velocity_between_the_buckets_weighted_by_demand() -> None:
    old = prefill_velocity(CAPS.values())
    assert old == 300.0  # the one-velocity rule: the slowest saturated bucket
    # 900 tok/s of short prompts, 100 of long: 1000 / (900/1200 + 100/300) = 923 tok/s
    v = demand_weighted(CAPS, {"128": 900.0, "2048": 100.0}, old)
    assert v == pytest.approx(1000 / (0.75 + 1 / 3))
    assert 300.0 < v < 1200.0
    # the mix moves it: mostly long prompts -> near the long bucket's velocity
    assert demand_weighted(CAPS, {"128": 100.0, "2048": 900.0}, old) == pytest.approx(1000 / (100 / 1200 + 3))
    assert demand_weighted(CAPS, {"128": 500.0}, old) == 1200.0  # short prompts only: the short bucket's
    # prefill need = demand / v_eff = sum of each bucket's demand over its velocity
    assert 1000 / v == pytest.approx(900 / 1200 + 100 / 300)


def test_no_per_bucket_demand_is_the_one_velocity_rule() -> None:
    old = prefill_velocity(CAPS.values())
    assert demand_weighted(CAPS, {}, old) == old  # an engine that does not count by bucket
    assert demand_weighted(CAPS, {"128": 0.0, "2048": 0.0}, old) == old  # an idle window
    # demand only where no capacity is measured: that bucket counts at the one-velocity rule
    assert demand_weighted(CAPS, {"512": 400.0}, old) == old
    assert demand_weighted(CAPS, {"512": 400.0, "128": 400.0}, old) == pytest.approx(800 / (400 / 300 + 400 / 1200))
    # no capacity at all: the floor rule's answer (every bucket at it), and nothing measured: None
    assert demand_weighted({}, {"128": 100.0}, 250.0) == 250.0
    assert demand_weighted({}, {"128": 100.0}, None) is None
    with pytest.raises(ValueError, match="fallback velocity must be > 0"):
        demand_weighted(CAPS, {"128": 1.0}, 0.0)


def test_measured_velocity_weights_both_prefill_velocities() -> None:
    m = MeasuredVelocity(300.0, 100.0, 5000.0, None, 300.0, tuple(sorted(CAPS.items())))
    w = m.weighted((("128", 900.0), ("2048", 100.0)))
    assert w.prefill_tokens_per_s == pytest.approx(923.08, abs=0.01)
    assert w.prefill_capacity_tokens_per_s == w.prefill_tokens_per_s  # the conversion policy's too
    assert (w.decode_tokens_per_s, w.network_tokens_per_s) == (100.0, 5000.0)
    assert m.weighted(()) == m
    floor_only = MeasuredVelocity(250.0)  # no saturated step: the floor stands, the capacity stays unknown
    assert floor_only.weighted((("128", 900.0),)) == floor_only


def _engine_text(m: EngineMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_engine_metrics_drive_the_weighted_velocity_and_the_prefill_count() -> None:
    """The engine's counter and velocity gauges (its own metrics code) -> parse -> rates -> snapshot: 2000 prompt
    tokens/s, 90 % of them short, need 2 prefillers at the weighted 923 tok/s where the slowest bucket asks 7."""
    m = EngineMetrics("m")
    meter = VelocityMeter(prefill=dict(CAPS), prefill_floor={"512": 150.0})
    PDMetrics(m.registry, "m").export_velocity(m.registry, lambda: meter)
    r = RateTracker()
    s0 = parse_engine_metrics(_engine_text(m), 0.0)
    assert s0.velocity is not None and s0.velocity.prefill_buckets == (("128", 1200.0), ("2048", 300.0))
    assert s0.velocity.prefill_tokens_per_s == 300.0  # one engine's reading: the one-velocity rule
    r.update("e", s0)
    for _ in range(18):
        m.on_request(100)  # bucket 128
    m.on_request(1500)  # bucket 2048
    m.on_request(500)  # bucket 512: no capacity there, counts at 300
    s1 = parse_engine_metrics(_engine_text(m), 1.0)
    assert dict(s1.prompt_arrived) == {"128": 1800.0, "512": 500.0, "2048": 1500.0, "inf": 0.0}
    load = r.update("e", s1)
    assert dict(load.prompt_tokens_per_s_by_bucket) == {"128": 1800.0, "512": 500.0, "2048": 1500.0, "inf": 0.0}
    snap = snapshot([load], 1.0)
    want = 3800 / (1800 / 1200 + 500 / 300 + 1500 / 300)
    assert snap.measured is not None and snap.measured.prefill_tokens_per_s == pytest.approx(want)
    assert snap.input_tokens_per_s == 3800.0
    d = decide(spec("disaggregated", lo=1, hi=16), "prefill", 1, 1, 16, snap)
    assert d.desired == 9  # 3800 / 465.3 = 8.2 -> 9; the slowest bucket alone: 3800 / 300 -> 13
    # the next window: short prompts only -> the short bucket's velocity
    for _ in range(20):
        m.on_request(100)
    snap2 = snapshot([r.update("e", parse_engine_metrics(_engine_text(m), 2.0))], 2.0)
    assert snap2.measured is not None and snap2.measured.prefill_tokens_per_s == pytest.approx(1200.0)
    assert decide(spec("disaggregated", lo=1, hi=16), "prefill", 1, 1, 16, snap2).desired == 2  # 2000/1200
    # an idle window: the one-velocity rule
    snap3 = snapshot([r.update("e", parse_engine_metrics(_engine_text(m), 3.0))], 3.0)
    assert snap3.measured is not None and snap3.measured.prefill_tokens_per_s == 300.0


def test_an_engine_without_the_counter_keeps_the_one_velocity_rule() -> None:
    m = EngineMetrics("m")
    meter = VelocityMeter(prefill=dict(CAPS))
    PDMetrics(m.registry, "m").export_velocity(m.registry, lambda: meter)
    r = RateTracker()
    r.update("e", parse_engine_metrics(_without_counter(m), 0.0))
    m.on_request(100)
    snap = snapshot([r.update("e", parse_engine_metrics(_without_counter(m), 1.0))], 1.0)
    assert snap.input_tokens_per_s == 100.0
    assert snap.prompt_tokens_per_s_by_bucket == ()
    assert snap.measured is not None and snap.measured.prefill_tokens_per_s == 300.0


def _without_counter(m: EngineMetrics) -> str:
    """An older engine's exposition: no per-bucket prompt counter."""
    return "\n".join(x for x in _engine_text(m).splitlines() if "kascade_prompt_tokens_arrived" not in x) + "\n"


async def test_prometheus_source_weights_the_same_way() -> None:
    """The same engine state through PromQL (per (pod, bucket) rows) gives the Scraper's weighted velocity."""
    def answer(q: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        if "kascade_prefill_velocity_tokens_per_second{" in q:
            assert q.startswith("max by (pod, bucket)") and "> 0" in q
            rows = [{"metric": {"pod": "p0", "bucket": b}, "value": [0, str(v)]} for b, v in CAPS.items()]
        elif "kascade_prompt_tokens_arrived_total{" in q:
            assert q.startswith("sum by (pod, bucket) (rate(")
            rows = [{"metric": {"pod": "p0", "bucket": b}, "value": [0, str(v)]}
                    for b, v in {"128": 1800.0, "512": 500.0, "2048": 1500.0, "inf": 0.0}.items()]
        elif "kascade_prompt_tokens_total{" in q:
            rows = [{"metric": {"pod": "p0"}, "value": [0, "3800"]}]
        return rows

    src = PrometheusSource("http://prom:9090", client=prometheus(answer))
    try:
        loads = await src.collect(["p0"])
    finally:
        await src.aclose()
    (p0,) = loads
    assert p0.velocity is not None and p0.velocity.prefill_tokens_per_s == 300.0  # one engine: the old rule
    assert p0.velocity.prefill_buckets == (("128", 1200.0), ("2048", 300.0))
    snap = snapshot(loads, 0.0)
    assert snap.measured is not None
    assert snap.measured.prefill_tokens_per_s == pytest.approx(3800 / (1800 / 1200 + 500 / 300 + 1500 / 300))
