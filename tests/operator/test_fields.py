"""Every API field does something: each test here fails if the operator ignores the field it names
(spec.slo, spec.scaling.threshold.metric=queueLength, spec.scaling.intervalSeconds, spec.model.source.pvc
and file:// uri, spec.model.dtype)."""

from __future__ import annotations

from typing import Any

from builders import pod, spec
from fakekube import FakeKube

from kascade_operator.decide import decide
from kascade_operator.engine_client import EngineClient
from kascade_operator.handlers import reconcile_service
from kascade_operator.metrics import InstanceSample, RateTracker, Scraper, parse_engine_metrics, snapshot
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.podtemplate import checkpoint_path
from kascade_operator.reconcile import CreatePlan, reconcile
from kascade_operator.runtime import Runtime
from kascade_operator.scaleplan import build, layout, spec_dict
from kascade_operator.settings import OperatorSettings
from kascade_planner.policies import MetricsSnapshot

HIST = """# TYPE kascade_time_to_first_token_seconds histogram
kascade_time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1
kascade_time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4
kascade_time_to_first_token_seconds_sum{model_name="m"} 2.0
kascade_time_to_first_token_seconds_count{model_name="m"} 4
# TYPE kascade_num_requests_waiting gauge
kascade_num_requests_waiting{model_name="m"} 7
"""


def test_latency_histograms_and_queue_are_read() -> None:
    s = parse_engine_metrics(HIST, 1.0)
    assert (s.ttft_sum, s.ttft_count, s.queue_length) == (2.0, 4.0, 7.0)
    r = RateTracker()
    r.update("a", InstanceSample(0.0, ttft_sum=1.0, ttft_count=2))
    load = r.update("a", InstanceSample(1.0, ttft_sum=3.0, ttft_count=4, queue_length=5))
    snap = snapshot([load], 1.0)
    assert snap.ttft_s == 1.0 and snap.queue_length == 5  # (3-1)/(4-2): the window's mean


def test_slo_ttft_asks_for_one_more_instance_when_missed() -> None:
    slow = MetricsSnapshot(0.0, ttft_s=0.9)
    without = decide(spec(lo=1, hi=4), "colocated", 2, 1, 4, slow)
    with_slo = decide(spec(lo=1, hi=4, slo={"ttftMs": 500}), "colocated", 2, 1, 4, slow)
    assert (without.desired, with_slo.desired) == (2, 3)
    assert "TTFT 900 ms > SLO 500 ms" in with_slo.reason
    met = decide(spec(lo=1, hi=4, slo={"ttftMs": 500}), "colocated", 2, 1, 4, MetricsSnapshot(0.0, ttft_s=0.2))
    assert met.desired == 2


def test_slo_tbt_drives_decoders_on_top_of_token_velocity() -> None:
    s = spec("disaggregated", lo=1, hi=8, slo={"tbtMs": 50},
             scaling={"tokenVelocity": {"prefillTokensPerSecond": 1000, "decodeTokensPerSecond": 100}})
    snap = MetricsSnapshot(0.0, output_tokens_per_s=150, tbt_s=0.08)
    assert decide(s, "decode", 2, 1, 8, snap).desired == 3  # velocity rule says 2; TBT 80 ms > 50 ms
    assert decide(s, "prefill", 2, 1, 8, snap).desired == 1  # TBT is not the prefillers' business


def test_threshold_on_queue_length_reads_the_queue_not_tokens() -> None:
    s = spec(lo=1, hi=8, scaling={"policy": "threshold", "threshold": {"metric": "queueLength", "upper": 4,
                                                                       "lower": 1}})
    busy = MetricsSnapshot(0.0, input_tokens_per_s=0.0, queue_length=20.0)
    assert decide(s, "colocated", 2, 1, 8, busy).desired == 5  # 20 waiting / 4 per instance
    tokens_only = MetricsSnapshot(0.0, input_tokens_per_s=1e6, queue_length=4.0)
    assert decide(s, "colocated", 2, 1, 8, tokens_only).desired == 2


def test_pvc_source_loads_its_first_copy_where_the_claim_is_mounted() -> None:
    s = spec(lo=1, model={"name": "m", "source": {"pvc": {"claimName": "w"}}})
    idle = [pod("pool-a", "n1"), pod("fb", "n2", created_for="svc")]
    (plan,) = [a for a in reconcile("svc", s, idle, []).actions if isinstance(a, CreatePlan)]
    assert plan.targets == ("fb",)  # not the pool pod: it does not mount the claim
    ready = [pod("r", "n0", "svc", "colocated", ready=True), *idle]
    (up,) = [a for a in reconcile("svc", s, ready, [], {"colocated": 3}).actions if isinstance(a, CreatePlan)]
    assert set(up.targets) == {"pool-a", "fb"}  # later copies stream from a GPU source: any pool pod


def test_source_path_of_the_first_copy_follows_the_source_kind() -> None:
    assert checkpoint_path(spec(model={"name": "m", "source": {"uri": "file:///data/m"}})) == "/data/m"
    assert checkpoint_path(spec(model={"name": "m", "source": {"pvc": {"claimName": "w"}}})) == "/kascade/model"
    nodes = [{"metadata": {"name": "n1", "labels": {"kascade.io/leaf": "l", "kascade.io/nic-gbps": "100",
                                                      "kascade.io/scaleup-domain": "d"}},
              "status": {"allocatable": {"nvidia.com/gpu": "8"}}}]
    p = pod("t", "n1")
    built = build(CreatePlan("colocated", (), ("t",), "x"), {"t": p}, nodes, layout("m", 2), "chain", 1)
    sd = spec_dict(built, "svc", "colocated", "x", "/data/m", dtype="float16")
    assert sd["sources"][0]["path"] == "/data/m" and sd["dtype"] == "float16"


async def test_interval_seconds_is_per_service() -> None:
    kube = FakeKube()
    rt = Runtime(OperatorSettings(engine_token="t"), kube, EngineClient("t"), Scraper(), None,
                 OperatorMetrics())

    def svc(name: str, interval: float) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": name, "generation": 1},
                "spec": {"model": {"name": "m", "source": {"path": "/m"}}, "engine": {"image": "i"},
                         "replicas": {"colocated": {"min": 0, "max": 2}},
                         "scaling": {"intervalSeconds": interval}}}

    try:
        fast = [await reconcile_service(rt, svc("fast", 0.05), "timer") is not None for _ in range(1)]
        slow = [await reconcile_service(rt, svc("slow", 30), "timer") is not None for _ in range(3)]
        import asyncio
        await asyncio.sleep(0.06)
        fast.append(await reconcile_service(rt, svc("fast", 0.05), "timer") is not None)
        assert fast == [True, True] and slow == [True, False, False]
    finally:
        await rt.engines.aclose()
