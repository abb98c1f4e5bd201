"""Pure operator pieces: metrics parsing and rates, pool choices and patches, ScalePlan specs and
progress, settings validation."""

from __future__ import annotations

import pytest
from builders import pod
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from kascade_operator import labels as L
from kascade_operator.metrics import InstanceSample, MetricsError, RateTracker, parse_engine_metrics, snapshot
from kascade_operator.pool import bind_patch, choose_drain, choose_targets, pod_view, unbind_patch
from kascade_operator.reconcile import CreatePlan
from kascade_operator.scaleplan import Throttle, build, layout, progress, spec_dict, to_instruct
from kascade_operator.settings import OperatorSettings

TEXT = """# HELP kascade_prompt_tokens_total Prompt tokens accepted
# TYPE kascade_prompt_tokens_total counter
kascade_prompt_tokens_total 1200.0
kascade_prompt_tokens_created 1.7e9
# TYPE kascade_generation_tokens_total counter
kascade_generation_tokens_total 300.0
# TYPE kascade_num_requests_waiting gauge
kascade_num_requests_waiting 3.0
# TYPE kascade_num_requests_running gauge
kascade_num_requests_running 2.0
# TYPE kascade_kv_cache_usage_perc gauge
kascade_kv_cache_usage_perc 0.25
# TYPE other_metric gauge
other_metric 99
"""


def test_parse_engine_metrics_reads_counters_and_gauges() -> None:
    s = parse_engine_metrics(TEXT, 10.0)
    assert (s.input_tokens, s.output_tokens, s.queue_length, s.running, s.kv_usage) == (1200, 300, 3, 2, 0.25)


def test_parse_what_prometheus_client_generates() -> None:
    r = CollectorRegistry()
    Counter("kascade_prompt_tokens", "x", registry=r).inc(42)
    Gauge("kascade_num_requests_waiting", "x", ["shard"], registry=r).labels("a").set(2)
    Gauge("kascade_num_requests_waiting_other", "x", registry=r).set(7)  # a different metric: ignored
    s = parse_engine_metrics(generate_latest(r).decode(), 1.0)
    assert (s.input_tokens, s.queue_length) == (42, 2)
    untyped = parse_engine_metrics("# TYPE kascade_prompt_tokens counter\nkascade_prompt_tokens_total 5\n", 1.0)
    assert untyped.input_tokens == 5


def test_parse_rejects_malformed_text() -> None:
    with pytest.raises(MetricsError, match="malformed"):
        parse_engine_metrics("kascade_num_requests_waiting not-a-number\n", 0.0)


def test_rates_and_counter_reset() -> None:
    r = RateTracker()
    assert r.update("a", InstanceSample(0.0, input_tokens=100)).input_tokens_per_s == 0.0  # first sample
    assert r.update("a", InstanceSample(0.5, input_tokens=600, output_tokens=50)).input_tokens_per_s == 1000.0
    reset = r.update("a", InstanceSample(1.0, input_tokens=20, output_tokens=5))  # engine restarted
    assert (reset.input_tokens_per_s, reset.output_tokens_per_s) == (40.0, 10.0)


def test_snapshot_sums_rates_and_averages_kv() -> None:
    r = RateTracker()
    for i in ("a", "b"):
        r.update(i, InstanceSample(0.0))
    loads = [
        r.update("a", InstanceSample(1.0, 100, 10, 1, 1, 0.2)),
        r.update("b", InstanceSample(1.0, 300, 30, 0, 2, 0.6)),
    ]
    s = snapshot(loads, 5.0)
    assert (s.input_tokens_per_s, s.output_tokens_per_s, s.in_flight, s.kv_usage) == (400, 40, 4, pytest.approx(0.4))


def test_pod_view_and_patches() -> None:
    raw = {"metadata": {"name": "e-1", "resourceVersion": "42", "labels": {L.POOL: "warm"},
                        "annotations": {L.ENDPOINT: "127.0.0.1:8001"}},
           "spec": {"nodeName": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    p = pod_view(raw, {"n1": "leaf-0"})
    assert (p.pool, p.model_service, p.ready, p.leaf, p.endpoint) == (True, None, False, "leaf-0", "127.0.0.1:8001")
    patch = bind_patch(p, "svc", "colocated", "svc-up-1")
    assert patch["metadata"]["resourceVersion"] == "42"  # optimistic concurrency guard
    assert patch["metadata"]["labels"] == {L.MODEL_SERVICE: "svc", L.ROLE: "colocated", L.POOL: L.POOL_BOUND}
    bound = pod(p.pod_name, ms="svc", role="colocated")
    with pytest.raises(ValueError, match="already bound to svc"):
        bind_patch(bound, "other", "colocated", "x")
    assert unbind_patch(bound)["metadata"]["labels"] == {L.MODEL_SERVICE: None, L.ROLE: None, L.POOL: L.POOL_WARM}


def test_choose_targets_skips_pods_without_endpoint_or_node() -> None:
    a, b = pod("a", leaf="l0"), pod("b", node="", leaf="l0")
    c = pod("c", leaf="l1").__class__(**{**pod("c", leaf="l1").__dict__, "endpoint": None})
    assert [p.pod_name for p in choose_targets([a, b, c], 3, {"l0"})] == ["a"]


def test_choose_drain_keeps_last_ready() -> None:
    pods = [pod("r1", ready=True), pod("r2", ready=True)]
    assert [p.pod_name for p in choose_drain(pods, 2)] == ["r2"]


NODES = [{"metadata": {"name": f"n{i}", "labels": {"kascade.io/leaf": f"l{i % 2}", "kascade.io/scaleup-domain": f"n{i}",
                                                  "kascade.io/nic-gbps": "100"}},
          "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for i in range(4)]


def test_scaleplan_spec_follows_topology_and_resumes() -> None:
    pods = {"src": pod("src", "n0", "svc", "colocated", ready=True, leaf="l0"),
            **{f"t{i}": pod(f"t{i}", f"n{i}", leaf=f"l{i % 2}") for i in (1, 2, 3)}}
    b = build(CreatePlan("colocated", ("src",), ("t1", "t2", "t3"), "up"), pods, NODES, layout("m", 4), "chain", 1)
    spec = spec_dict(b, "svc", "colocated", "threshold: 900 > 500")
    assert spec["modelServiceRef"] == {"name": "svc"} and spec["algorithm"] == "chain"
    assert {t["pod"] for t in spec["targets"]} == {"t1", "t2", "t3"}
    chain_members = [i for c in spec["chains"] for i in c]
    assert chain_members[0] == "src" and set(chain_members) == {"src", "t1", "t2", "t3"}
    assert spec["blockOrder"] == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "head"]
    assert to_instruct(spec, None) == [t["instance"] for t in spec["targets"]]
    status = progress(spec, {"t1": {"blocks": {"embed": True}, "ready": False}}, {"t1"}, {}, 0.0, 1.0)
    assert status["phase"] == "Transferring" and status["progress"] == "1/18"
    assert to_instruct(spec, status) == sorted({"t2", "t3"}, key=[t["instance"] for t in spec["targets"]].index)
    done = progress(spec, {t: {"ready": True, "bytesReceived": 10} for t in ("t1", "t2", "t3")},
                    {"t1", "t2", "t3"}, {}, 0.0, 2.0)
    assert done["phase"] == "Succeeded" and done["durationSeconds"] == 2.0 and done["targetsReady"] == "3/3"
    # a dead target is dropped; the plan goes on for the others and succeeds once they are all ready
    going = progress(spec, {}, {"t1"}, {"t2": "connection refused"}, 0.0, 1.0)
    assert going["phase"] == "Transferring" and "t2: connection refused" in going["message"]
    row = {r["instance"]: r for r in going["targets"]}["t2"]
    assert row["failed"] == "connection refused" and row["ready"] is False
    rest = progress(
        spec, {t: {"ready": True} for t in ("t1", "t2", "t3")}, {"t1", "t2", "t3"}, {"t2": "dead"}, 0.0, 2.0
    )
    assert rest["phase"] == "Succeeded" and rest["targetsReady"] == "2/3" and "t2: dead" in rest["message"]
    none = progress(spec, {}, {"t1"}, {t: "dead" for t in ("t1", "t2", "t3")}, 0.0, 1.0)
    assert none["phase"] == "Failed"


def test_first_copy_plans_local_load() -> None:
    pods = {"t1": pod("t1", "n1")}
    b = build(CreatePlan("colocated", (), ("t1",), "min"), pods, NODES, layout("m", 2), "chain", 1)
    assert b.plan.algorithm == "local"


def test_throttle_lets_phase_changes_through() -> None:
    t = [0.0]
    th = Throttle(1.0, clock=lambda: t[0])
    assert th.should_write("Transferring")
    t[0] = 0.5
    assert not th.should_write("Transferring")
    assert th.should_write("Succeeded")
    t[0] = 1.6
    assert th.should_write("Succeeded")


def test_settings_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KASCADE_OPERATOR_METRICS_SOURCE", "prometheus")
    with pytest.raises(ValidationError, match="KASCADE_OPERATOR_PROMETHEUS_URL"):
        OperatorSettings()
    monkeypatch.setenv("KASCADE_OPERATOR_METRICS_SOURCE", "scrape")
    monkeypatch.setenv("KASCADE_OPERATOR_INTERVAL_SECONDS", "0.2")
    assert OperatorSettings().interval_seconds == 0.2
    monkeypatch.setenv("KASCADE_OPERATOR_INTERVAL_SECONDS", "0.001")
    with pytest.raises(ValidationError, match="interval_seconds"):
        OperatorSettings()


async def test_scraper_keeps_rates_per_group() -> None:
    """Scraping service B between two scrapes of service A must not reset A's rate (a real bug)."""
    from enginestub import EngineStub, FakeClock

    from kascade_operator.metrics import Scraper

    clock = FakeClock()
    a, b = EngineStub("a", "m", "t", clock=clock), EngineStub("b", "m", "t", clock=clock)
    a.tokens_per_s = 1000.0
    scraper = Scraper(timeout_s=2.0, clock=clock)
    try:
        await scraper.collect({"a": a.endpoint}, "A")
        clock.advance(0.1)
        await scraper.collect({"b": b.endpoint}, "B")
        clock.advance(0.1)
        (load,) = await scraper.collect({"a": a.endpoint}, "A")
        assert load.input_tokens_per_s == pytest.approx(1000.0)  # a reset by B's scrape would read 0 or none
    finally:
        await scraper.aclose()
        a.close()
        b.close()


def test_plan_duration_series_exist_at_zero_before_the_first_plan_ends() -> None:
    # rate() of a series born at 1 is 0 (NaN quantiles on the dashboard): each outcome starts at 0
    from prometheus_client import generate_latest

    from kascade_operator.operator_metrics import OperatorMetrics
    m = OperatorMetrics()
    m.observe_service("ns", "svc", {}, [])
    text = generate_latest(m.registry).decode()
    for phase in ("Succeeded", "Failed"):
        assert (
            f'kascade_operator_plan_duration_seconds_count{{model_service="svc",namespace="ns",phase="{phase}"}} 0.0'
            in text
        )
