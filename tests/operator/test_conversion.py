"""Convertible decoders driven by the operator, in process: reconcile rounds of a disaggregated service
against the in-memory kube layer (fakekube.py) and real-HTTP engine stubs (enginestub.py). A prefill
burst (prompt tokens/s above the prefillers' velocity) converts decoders: the engine's `/convert` gets
the chunk budget derived from spec.slo.tbtMs, then the pod is annotated; when the demand falls back under
the capacity both are taken back. Also the P:D ratio policy through `decide_roles`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from enginestub import EngineStub, FakeClock
from fakekube import FakeKube, merge
from stubruntime import stub_runtime

from kascade_operator import labels as L
from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleInput, decide_roles
from kascade_operator.handlers import reconcile_service
from kascade_operator.metrics import Scraper
from kascade_operator.runtime import Runtime
from kascade_planner.conversion import plan_conversions
from kascade_planner.policies import MeasuredVelocity, MetricsSnapshot

NS, TOKEN = "ns", "conv-token"
ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}


def service(prefill: tuple[int, int] = (1, 1), decode: tuple[int, int] = (2, 2), **scaling: Any) -> dict[str, Any]:
    return {"metadata": {"name": "svc", "namespace": NS, "uid": "uid-svc", "generation": 1},
            "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "mode": "disaggregated",
                     "replicas": {"prefill": {"min": prefill[0], "max": prefill[1]},
                                  "decode": {"min": decode[0], "max": decode[1]}},
                     "slo": {"tbtMs": 200, "ttftMs": 1200},
                     "scaling": {"policy": "tokenVelocity", "intervalSeconds": 0.05, "idleReleaseSeconds": 3600,
                                 "tokenVelocity": {"prefillTokensPerSecond": 100, "decodeTokensPerSecond": 1000},
                                 **scaling}}}


@pytest.fixture
async def world() -> AsyncIterator[tuple[Runtime, FakeKube, dict[str, EngineStub]]]:
    kube = FakeKube()
    kube.nodes = [{"metadata": {"name": "n0", "labels": {"kascade.io/leaf": "l0"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}]
    clock = FakeClock()  # the stubs count tokens on it and the scraper reads it: rates are exact
    stubs = {n: EngineStub(n, "tiny", TOKEN, clock=clock) for n in ROLES}
    for n, s in stubs.items():  # already bound and loaded: this test is about what happens next
        kube.add_pool_pod(NS, n, "n0", s.endpoint, model="tiny")
        merge(
            kube.pods[(NS, n)],
            {
                "metadata": {
                    "labels": {L.MODEL_SERVICE: "svc", L.ROLE: ROLES[n], L.POOL: L.POOL_BOUND},
                    "annotations": {L.LOADED: "true"},
                }
            },
        )
        s.model_service, s.role, s.phase = "svc", ROLES[n], "serving"
    async with stub_runtime(kube, stubs.values(), TOKEN, clock) as rt:
        yield rt, kube, stubs


def converted(kube: FakeKube) -> list[str]:
    return sorted(n for (_, n), p in kube.pods.items() if p["metadata"]["annotations"].get(L.CONVERTIBLE) == "true")


def convert_calls(stub: EngineStub) -> list[Any]:
    return [body["prefillChunkTokens"] for verb, body, _ in stub.calls if verb == "convert"]


async def rounds(rt: Runtime, n: int = 2) -> None:
    assert isinstance(rt.scraper, Scraper) and isinstance(rt.scraper.clock, FakeClock)
    for _ in range(n):  # two scrapes make a rate: each round half a second after the last on the stubs' clock
        rt.scraper.clock.advance(0.5)
        rt.last_round.clear()
        await reconcile_service(rt, service(), "timer")


async def test_a_prefill_burst_converts_decoders_and_new_capacity_takes_them_back(world: Any) -> None:
    rt, kube, stubs = world
    stubs["d0"].tokens_per_s = stubs["d1"].tokens_per_s = 62.5  # 125 prompt tok/s arrive; 1 prefiller does 100
    await rounds(rt)
    # deficit 25 tok/s, a converted decoder adds 50: one converts, the first by name (equal load)
    assert converted(kube) == ["d0"]
    assert convert_calls(stubs["d0"]) == [10]  # chunk budget 0.5 x 200 ms x 100 tok/s
    # and the step time budget the engine cuts its chunks to: 0.8 x the 200 ms objective
    assert [b.get("stepBudgetMs") for v, b, _ in stubs["d0"].calls if v == "convert"] == [pytest.approx(160.0)]
    # and the hand-back bound, from the TTFT objective: 0.25 x spec.slo.ttftMs
    ttft_ms = service()["spec"]["slo"]["ttftMs"]
    assert [b.get("handBackMs") for v, b, _ in stubs["d0"].calls if v == "convert"] == [pytest.approx(0.25 * ttft_ms)]
    assert convert_calls(stubs["d1"]) == [] and convert_calls(stubs["p0"]) == []
    assert any(e["reason"] == "ConvertDecoders" and "convert d0" in e["message"] for e in kube.events)

    stubs["d0"].tokens_per_s = stubs["d1"].tokens_per_s = 1000.0  # a bigger burst: the other one converts too
    await rounds(rt)
    assert converted(kube) == ["d0", "d1"] and convert_calls(stubs["d0"]) == [10]  # d0 is not asked again

    stubs["d0"].tokens_per_s = stubs["d1"].tokens_per_s = 20.0  # under the prefill capacity: both go back
    await rounds(rt, 3)
    assert converted(kube) == []
    assert convert_calls(stubs["d0"]) == [10, None] and convert_calls(stubs["d1"]) == [10, None]
    assert any(e["reason"] == "RevertDecoders" for e in kube.events)


async def test_an_engine_refusing_the_conversion_leaves_the_pod_unannotated(world: Any) -> None:
    rt, kube, stubs = world
    stubs["d0"].close()  # its engine is gone: the convert call fails, so no prefill may be routed to it
    stubs["d1"].tokens_per_s = 125.0
    await rounds(rt, 3)
    assert converted(kube) == []  # the policy picked d0 (first by name) every round; it never accepted
    assert convert_calls(stubs["d1"]) == []  # one decoder was wanted, none more
    assert not any(e["reason"] == "ConvertDecoders" for e in kube.events)


def test_the_pd_ratio_policy_sizes_both_roles_from_the_arrival_rate() -> None:
    spec = ModelServiceSpec.model_validate(service((0, 4), (1, 8))["spec"])
    # decoders saw 450 prompt tok/s arrive (the prefiller served only 100 of them) and 2500 output tok/s
    rnd = decide_roles(spec, [RoleInput("prefill", 1, 0, 4, MetricsSnapshot(0.0, 100.0, 0.0)),
                              RoleInput("decode", 1, 1, 8, MetricsSnapshot(0.0, 450.0, 2500.0))], "timer")
    assert dict(rnd.desired) == {"prefill": 4, "decode": 3}  # 4.5 -> 4 (max); 2.5 decoders -> 3
    pre, dec = rnd.decisions
    assert pre.reason.startswith("P:D ratio") and "prefill capped at max 4" in pre.reason
    assert dec.metrics["servedFraction"] == pytest.approx(4 / 4.5)
    # measured velocities fill what is not typed (here: all of them)
    spec2 = ModelServiceSpec.model_validate({**service((0, 4), (1, 8))["spec"], "scaling": {"policy": "tokenVelocity"}})
    meas = MeasuredVelocity(prefill_tokens_per_s=200.0, decode_tokens_per_s=500.0, network_tokens_per_s=150.0)
    rnd = decide_roles(spec2, [RoleInput("prefill", 1, 0, 4, MetricsSnapshot(0.0, 300.0, 0.0, measured=meas)),
                               RoleInput("decode", 1, 1, 8, MetricsSnapshot(0.0, 300.0, 1000.0))], "timer")
    assert dict(rnd.desired) == {"prefill": 2, "decode": 2}  # 300/150 link-bound; 1000/500


async def test_a_stale_pod_version_is_read_again_but_only_a_still_bound_decoder_is_annotated(world: Any) -> None:
    from kascade_operator.converter import _annotate
    from kascade_operator.kube import Conflict
    from kascade_operator.pool import pod_view

    rt, kube, _stubs = world
    stale = pod_view(kube.pods[(NS, "d0")])
    await kube.patch_pod(NS, "d0", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})  # rv moves on
    await _annotate(rt, NS, stale, "svc")
    assert converted(kube) == ["d0"]
    stale = pod_view(kube.pods[(NS, "d1")])
    await kube.patch_pod(NS, "d1", {"metadata": {"labels": {L.MODEL_SERVICE: None, L.ROLE: None}}})  # unbound meanwhile
    with pytest.raises(Conflict):
        await _annotate(rt, NS, stale, "svc")
    assert converted(kube) == ["d0"]


def test_the_conversion_input_carries_the_decoders_measured_share_of_a_prefiller() -> None:
    """`pdscaling.conversion_input` gives the policy the decoders' prefill rate over the prefillers' (both as
    the engines measured them, `prefill_rate_tokens_per_s`), so the operator converts as many decoders as that
    share needs; None (the policy's constant) until both roles measured one."""
    from kascade_operator.pdscaling import conversion_input
    from kascade_operator.pool import PodView

    spec = ModelServiceSpec.model_validate(service((1, 1), (1, 8))["spec"])
    pods = [PodView("p0", "n", "1", True, "svc", "prefill", True, endpoint="h:1"),
            *(PodView(f"d{i}", "n", "1", True, "svc", "decode", True, endpoint=f"h:{2 + i}") for i in range(6))]

    def roles(p_rate: float | None, d_rate: float | None) -> list[RoleInput]:
        return [RoleInput("prefill", 1, 1, 1, MetricsSnapshot(0.0, 220.0, 0.0, measured=MeasuredVelocity(
                    prefill_rate_tokens_per_s=p_rate))),
                RoleInput("decode", 6, 1, 8, MetricsSnapshot(0.0, 220.0, 0.0, measured=MeasuredVelocity(
                    prefill_rate_tokens_per_s=d_rate)))]

    inp = conversion_input(spec, "svc", pods, roles(900.0, 90.0))
    assert inp is not None and inp.converted_share == pytest.approx(0.1)
    # typed velocity 100 tok/s, 220 arriving: deficit 120 at 0.1 of a prefiller each -> all 6 (3 at the constant)
    assert plan_conversions(inp).converted == 6
    unmeasured = conversion_input(spec, "svc", pods, roles(900.0, None))
    assert unmeasured is not None and unmeasured.converted_share is None
    assert plan_conversions(unmeasured).converted == 3


def test_the_conversion_policy_takes_a_prefillers_capacity_never_its_floor() -> None:
    """Measured velocities (none typed): the conversion policy gets the prefill velocity of saturated steps only.
    Before one, the engines report their best unsaturated step (a lower bound) and the policy holds: 121 prompt
    tok/s against a 83 tok/s floor is no deficit (bench/pd.py converted on it at 0.59 s).
    With the capacity measured, the deficit and the chunk budget are sized from it; the P:D ratio policy still
    reads the floor (kascade_planner.prefillvelocity)."""
    from kascade_operator.pdscaling import conversion_input, velocities
    from kascade_operator.pool import PodView

    spec = ModelServiceSpec.model_validate({**service((1, 1), (1, 8))["spec"], "scaling": {"policy": "tokenVelocity"},
                                            "slo": {"tbtMs": 730}})
    pods = [PodView("p0", "n", "1", True, "svc", "prefill", True, endpoint="h:1"),
            PodView("d0", "n", "1", True, "svc", "decode", True, endpoint="h:2")]

    def roles(m: MeasuredVelocity, rate: float) -> list[RoleInput]:
        return [RoleInput("prefill", 1, 1, 1, MetricsSnapshot(0.0, rate, 0.0, measured=m)),
                RoleInput("decode", 1, 1, 8, MetricsSnapshot(0.0, rate, 0.0))]

    floor_only = roles(MeasuredVelocity(prefill_tokens_per_s=83.0), 121.0)
    inp = conversion_input(spec, "svc", pods, floor_only)
    assert inp is not None and inp.prefill_tokens_per_s is None
    plan = plan_conversions(inp)
    assert plan.convert == () and "no saturated step yet" in plan.reason
    assert velocities(spec, [r.snap for r in floor_only]).prefill == 83.0  # the ratio policy's: the floor
    cap = MeasuredVelocity(prefill_tokens_per_s=480.0, prefill_capacity_tokens_per_s=480.0)
    assert plan_conversions(conversion_input(spec, "svc", pods, roles(cap, 121.0))).convert == ()  # no deficit
    burst = conversion_input(spec, "svc", pods, roles(cap, 700.0))
    assert burst is not None and burst.prefill_tokens_per_s == 480.0
    assert plan_conversions(burst).convert == ("d0",) and plan_conversions(burst).chunk_tokens == 175  # 0.365 s x 480
