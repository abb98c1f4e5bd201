"""The apply side in process: reconcile rounds and the ScalePlan driver against the in-memory kube layer
(fakekube.py) and real-HTTP engine stubs (enginestub.py), without an operator process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime

from kascade_operator import labels as L
from kascade_operator import plandriver, rounds
from kascade_operator.handlers import queued_round, reconcile_service
from kascade_operator.metricsview import MetricsView
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings
from kascade_operator.workqueue import WorkQueue

NS, TOKEN = "ns", "seam-token"


def service(name: str = "svc", model: str = "tiny", lo: int = 1, hi: int = 3, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": {"model": {"name": model, "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": lo, "max": hi}},
                     **spec}}


@pytest.fixture
async def world() -> AsyncIterator[tuple[Runtime, FakeKube, list[EngineStub]]]:
    kube = FakeKube()
    kube.nodes = [
        {
            "metadata": {
                "name": f"n{i}",
                "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100", "kascade.io/scaleup-domain": f"d{i}"},
            },
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}},
        }
        for i in range(3)
    ]
    stubs = [EngineStub(f"e{i}", "tiny", TOKEN, auto_ready=False) for i in range(3)]
    for i, s in enumerate(stubs):
        kube.add_pool_pod(NS, s.instance, f"n{i}", s.endpoint, model="tiny")
    async with stub_runtime(kube, stubs, TOKEN) as rt:
        yield rt, kube, stubs


def bound_pods(kube: FakeKube, svc: str = "svc") -> list[dict[str, Any]]:
    return [p for p in kube.pods.values() if (p["metadata"].get("labels") or {}).get(L.MODEL_SERVICE) == svc]


async def test_bind_labels_only_after_the_engine_accepted_and_owns_the_pod(world: Any) -> None:
    rt, kube, stubs = world
    await reconcile_service(rt, service(), "create")
    (pod,) = bound_pods(kube)
    stub = next(s for s in stubs if s.instance == pod["metadata"]["name"])
    assert stub.count("bind") == 1 and stub.model_service == "svc"
    assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService",
                                                   "name": "svc", "uid": "uid-svc", "controller": True,
                                                   "blockOwnerDeletion": True}]
    (sp,) = kube.plans.values()
    assert sp["metadata"]["ownerReferences"][0]["uid"] == "uid-svc"


async def test_bind_refused_drops_the_target_and_leaves_the_pod_unlabelled(world: Any) -> None:
    rt, kube, stubs = world
    for s in stubs:  # every engine already belongs to another service (e.g. a second operator's)
        s.model_service, s.phase = "other", "serving"
    await reconcile_service(rt, service(), "create")
    assert bound_pods(kube) == []
    (sp,) = kube.plans.values()
    (row,) = sp["status"]["targets"]
    assert "bind refused" in row["failed"] and "other" in row["failed"]
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Failed"
    assert any(e["reason"] == "TargetDropped" for e in kube.events)


async def test_target_pod_deleted_mid_plan_is_dropped_and_replaced(world: Any) -> None:
    rt, kube, _stubs = world
    await reconcile_service(rt, service(), "create")
    (pod,) = bound_pods(kube)
    (sp,) = kube.plans.values()
    del kube.pods[(NS, pod["metadata"]["name"])]  # deleted while its engine is still loading
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)  # used to poll forever
    st = kube.plans[(NS, sp["metadata"]["name"])]["status"]
    assert st["phase"] == "Failed" and "was deleted" in st["targets"][0]["failed"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Stalled"] == "True"
    await reconcile_service(rt, service(), "update")
    plans = sorted(kube.plans.values(), key=lambda p: p["metadata"]["name"])
    assert len(plans) == 2 and plans[1]["spec"]["targets"][0]["pod"] != pod["metadata"]["name"]


async def test_two_models_in_one_pool_never_take_each_others_pods(world: Any) -> None:
    rt, kube, _stubs = world
    other = EngineStub("q0", "qwen", TOKEN, auto_ready=True)
    try:
        kube.add_pool_pod(NS, "q0", "n0", other.endpoint, model="qwen")
        await reconcile_service(rt, service("a", "tiny", lo=1), "create")
        await reconcile_service(rt, service("b", "qwen", lo=1), "create")
        assert [p["metadata"]["name"] for p in bound_pods(kube, "b")] == ["q0"]
        assert bound_pods(kube, "a")[0]["metadata"]["name"] != "q0"
        assert all(e["reason"] != "TargetDropped" for e in kube.events)  # zero refused binds
    finally:
        other.close()


async def test_exhausted_pool_creates_the_missing_pods_once(world: Any) -> None:
    rt, kube, _stubs = world
    rt.settings = OperatorSettings(engine_token=TOKEN, engine_image="kascade:dev", allowed_host_path_roots=["/models"])
    svc = service(lo=5, hi=6)  # 3 pool pods, 5 wanted
    for _ in range(5):
        await reconcile_service(rt, svc, "timer")
        rt.last_round.clear()
    created = [p for p in kube.pods.values() if L.CREATED_FOR in p["metadata"].get("annotations", {})]
    assert len(created) == 2
    assert created[0]["metadata"]["ownerReferences"][0]["name"] == "svc"


async def test_forbidden_fallback_names_the_field(world: Any) -> None:
    rt, kube, _stubs = world
    svc = service(lo=5, hi=6)
    svc["spec"]["model"]["source"] = {"path": "/"}
    await reconcile_service(rt, svc, "create")
    assert not [p for p in kube.pods.values() if L.CREATED_FOR in p["metadata"].get("annotations", {})]
    stalled = next(c for c in kube.service_status["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "Forbidden"
    assert "spec.engine.image" in stalled["message"] and "spec.model.source.path" in stalled["message"]


async def test_events_are_rate_limited_per_object_and_reason(world: Any) -> None:
    rt, kube, _ = world
    body = service()
    for _ in range(10):
        await rt.event(NS, body, "ModelService", "Warning", "PoolShort", "short")
    await rt.event(NS, body, "ModelService", "Normal", "ScaleUp", "up")
    reasons = [e["reason"] for e in kube.events]
    assert reasons.count("PoolShort") == 3 and reasons.count("ScaleUp") == 1 and rt.events_suppressed == 7


async def test_history_limit_keeps_the_newest_finished_plans(world: Any) -> None:
    rt, kube, _ = world
    for i in range(4):
        await kube.create_scaleplan(
            NS,
            {
                "metadata": {"name": f"svc-old-{i}"},
                "spec": {"modelServiceRef": {"name": "svc"}, "role": "colocated"},
                "status": {"phase": "Succeeded", "completionTime": f"2026-01-0{i + 1}T00:00:00Z"},
            },
        )
    await reconcile_service(rt, service(scalePlanHistoryLimit=2), "create")
    names = sorted(n for (_, n) in kube.plans)
    assert "svc-old-0" not in names and "svc-old-1" not in names and {"svc-old-2", "svc-old-3"} <= set(names)


async def test_pool_in_another_namespace_serves_services_of_every_namespace(world: Any) -> None:
    rt, kube, stubs = world
    rt.settings = OperatorSettings(engine_token=TOKEN, pool_namespace="pool")
    for (ns, name), p in list(kube.pods.items()):  # move the pool to its own namespace
        del kube.pods[(ns, name)]
        p["metadata"]["namespace"] = "pool"
        kube.pods[("pool", name)] = p
    a, b = service("chat"), service("chat")
    b["metadata"].update(namespace="other", uid="uid-other-chat")
    await reconcile_service(rt, a, "create")
    await reconcile_service(rt, b, "create")
    bound = [p for p in kube.pods.values() if (p["metadata"].get("labels") or {}).get(L.MODEL_SERVICE) == "chat"]
    assert len(bound) == 2  # same name, two namespaces: two different pods
    assert sorted(p["metadata"]["annotations"][L.SERVICE_NS] for p in bound) == ["ns", "other"]
    assert all(not p["metadata"].get("ownerReferences") for p in bound)  # no owner across namespaces
    assert sorted(s.model_service for s in stubs if s.model_service) == ["ns/chat", "other/chat"]


class NoRouter:
    """A configured router that cannot be read yet (starting, restarting)."""
    async def get(self, ns: str, name: str) -> None:
        return None


@pytest.mark.parametrize("trigger", ["create", "update", "timer"])
async def test_min_zero_stays_at_zero_on_every_trigger_while_nothing_asks(world: Any, trigger: str) -> None:
    """The policy alone would keep one copy; with min 0 and a router the zero rule's 0 must win on a create
    or update round too (it once did only on timer rounds, and every new min-0 service loaded a copy)."""
    rt, kube, _ = world
    rt.router = NoRouter()
    threshold = {"policy": "threshold", "threshold": {"metric": "tokensPerSecond", "upper": 100, "lower": 0}}
    await reconcile_service(rt, service(lo=0, hi=2, scaling=threshold), trigger)
    assert bound_pods(kube) == [] and kube.plans == {}


async def test_a_lost_bind_label_is_written_again_and_the_plan_finishes(world: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine accepted the bind but the pod's label write was lost (once a 409 read as success): the
    driver re-reads the pod after LABEL_LIMIT_S, labels it again, and the plan ends instead of waiting
    forever on a pod that never shows as bound."""
    rt, kube, stubs = world
    monkeypatch.setattr(plandriver, "LABEL_LIMIT_S", 0.3)
    await reconcile_service(rt, service(), "create")
    (pod,) = bound_pods(kube)
    (sp,) = kube.plans.values()
    labels = pod["metadata"]["labels"]
    kept = {k: v for k, v in labels.items() if k not in (L.MODEL_SERVICE, L.ROLE)}
    kube.pods[(NS, pod["metadata"]["name"])]["metadata"]["labels"] = {**kept, L.POOL: "warm"}  # the write "lost"
    assert bound_pods(kube) == []
    stub = next(s for s in stubs if s.instance == pod["metadata"]["name"])
    stub.phase = "serving"
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    assert [p["metadata"]["name"] for p in bound_pods(kube)] == [pod["metadata"]["name"]]
    assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Succeeded"
    assert stub.count("bind") == 1  # the engine is not told twice


async def test_a_role_object_sets_its_roles_count_and_gets_its_status(world: Any) -> None:
    rt, kube, _ = world
    kube.roles = {(NS, "svc-prefill"): {"metadata": {"name": "svc-prefill", "namespace": NS, "generation": 4,
                                                     "creationTimestamp": "2026-01-01T00:00:00Z"},
                                        "spec": {"modelServiceRef": {"name": "svc"}, "role": "prefill", "replicas": 2}}}
    body = service(mode="disaggregated", replicas={"prefill": {"min": 0, "max": 2}, "decode": {"min": 1, "max": 1}})
    await reconcile_service(rt, body, "create")
    targets = {sp["spec"]["role"]: len(sp["spec"]["targets"]) for sp in kube.plans.values()}
    assert targets == {"prefill": 2, "decode": 1}  # without the object, prefill (min 0, no load) stays at 0
    st = kube.roles[(NS, "svc-prefill")]["status"]
    assert st["selector"] == "kascade.io/model-service=svc,kascade.io/role=prefill"
    assert st["effectiveReplicas"] == 2 and st["observedGeneration"] == 4
    assert {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]} == {
        "Ready": ("True", "Following"), "Stalled": ("False", "Following")}


class CancelledByOwnWrite(FakeKube):
    """kopf stops a plan's daemon when the watch shows its phase terminal, often before the terminal write's
    own response is read: that await raises CancelledError in the driver."""

    async def patch_scaleplan_status(self, ns: str, name: str, status: dict[str, Any],
                                     resource_version: str | None = None) -> None:
        await super().patch_scaleplan_status(ns, name, status, resource_version)
        if status.get("phase") in ("Succeeded", "Failed"):
            raise asyncio.CancelledError


async def test_a_plan_records_its_outcome_even_when_its_terminal_write_cancels_the_driver(world: Any) -> None:
    rt, kube, stubs = world
    kube.__class__ = CancelledByOwnWrite  # the same in-memory cluster; its terminal write now cancels
    await reconcile_service(rt, service(), "create")
    (sp,) = kube.plans.values()
    for s in stubs:
        s.phase = "serving"
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Succeeded"
    # the duration metric and the Event (recorded after the write before: lost in ~1 plan of 5)
    count = rt.metrics.registry.get_sample_value("kascade_operator_plan_duration_seconds_count",
                                                 {"namespace": NS, "model_service": "svc", "phase": "Succeeded"})
    assert count == 1.0
    assert [e["reason"] for e in kube.events if e["reason"].startswith("ScalePlan")] == ["ScalePlanSucceeded"]


async def serving_one(world: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The service created with every engine stub answering ready, its first plan driven to the end: (that plan,
    the one serving pod)."""
    rt, kube, stubs = world
    for s in stubs:
        s.auto_ready = True
    await reconcile_service(rt, service(), "create")
    (first,) = kube.plans.values()
    await asyncio.wait_for(plandriver.drive(rt, first, Stopped()), 10)
    (serving,) = bound_pods(kube)
    return first, serving


async def test_a_service_is_steady_only_once_nothing_moves_and_then_waits_for_the_resync(world: Any) -> None:
    """Event-driven rounds (rounds.py): while a plan runs the next round is one interval away; once the
    service holds its count with nothing in flight it is steady, and the next round waits for the resync
    (or a change that wakes it)."""
    rt, kube, stubs = world
    rt.view = MetricsView(rt.scraper, max_age_s=1.0)  # as the operator runs: rounds read the sweep's view
    rt.queue = WorkQueue(lambda key: asyncio.sleep(0))  # not started: only its due times are read
    body = service(scaling={"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}})
    await reconcile_service(rt, body, "create")
    assert rt.steady[(NS, "svc")][1] is False  # a plan was created
    rounds.after_round(rt, NS, "svc")
    assert (rt.queue.due_in((NS, "svc")) or 0) <= 1.0
    (sp,) = kube.plans.values()
    for s in stubs:
        s.phase = "serving"
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    for _ in range(2):  # the first round after the plan may still see it in flight
        rt.last_round.clear()
        await reconcile_service(rt, body, "timer")
    assert rt.steady[(NS, "svc")][1] is True
    rt.queue.forget((NS, "svc"))
    rounds.after_round(rt, NS, "svc")
    assert (rt.queue.due_in((NS, "svc")) or 0) > rt.settings.resync_seconds - 1
    rounds.wake(rt, NS, "svc")  # e.g. a pod of it changed: due within its interval, not at the resync
    assert (rt.queue.due_in((NS, "svc")) or 99) <= 1.0
    assert rt.queue.urgent((NS, "svc"))  # an input change: ahead of every due resync


async def test_a_metrics_wake_right_after_a_round_runs_a_round_at_once(world: Any) -> None:
    """The sweep saw the service's loads change just after a round: the round comes now (not after 0.95 of
    its interval, not skipped by observe); a pod wake at that moment still waits out the rate limit."""
    rt, _kube, _stubs = world
    rt.view = MetricsView(rt.scraper, max_age_s=1.0)
    rt.queue = WorkQueue(lambda key: asyncio.sleep(0))  # not started: due times read, rounds run by hand
    body = service(scaling={"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}})
    rt.service_index = {(NS, "svc"): [body]}
    await reconcile_service(rt, body, "create")
    last = rt.last_round[(NS, "svc")]
    rounds.wake(rt, NS, "svc")  # a pod event: rate-limited to 0.95 interval after the round
    assert 0.5 < (rt.queue.due_in((NS, "svc")) or 0) <= 0.95
    rounds.wake(rt, NS, "svc", metrics=True)  # the sweep: due now, and urgent
    assert (rt.queue.due_in((NS, "svc")) or 99) <= 0 and rt.queue.urgent((NS, "svc"))
    await queued_round(rt, (NS, "svc"))
    assert rt.last_round[(NS, "svc")] > last  # it ran: observe did not skip it as a too-early tick
    assert (NS, "svc") not in rt.metric_woken
    last = rt.last_round[(NS, "svc")]
    await queued_round(rt, (NS, "svc"))  # a plain queued tick this soon is still skipped
    assert rt.last_round[(NS, "svc")] == last


@pytest.mark.parametrize("watch_s", [30.0, 0.0])
async def test_a_crossing_between_sweeps_wakes_the_round_through_the_load_watch(world: Any, watch_s: float) -> None:
    """The sweep (rounds.sweep_forever) holds a load watch on each engine it scrapes: a load raised between
    sweeps wakes the service (urgent, metrics) long before the next sweep; with load_watch_seconds 0 nothing
    is held and the crossing waits for the sweep."""
    rt, kube, stubs = world
    rt.settings = rt.settings.model_copy(update={"interval_seconds": 60.0, "load_watch_seconds": watch_s,
                                                 "pool_namespace": NS})
    rt.queue = WorkQueue(lambda key: asyncio.sleep(0))  # not started: the wake is read from it
    body = service(scaling={"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}})
    await reconcile_service(rt, body, "create")
    (sp,) = kube.plans.values()
    for s in stubs:
        s.phase = "serving"
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    (bound,) = [s for s in stubs if s.model_service]
    view = rt.view = MetricsView(rt.scraper, max_age_s=60.0)
    task = asyncio.create_task(rounds.sweep_forever(rt, view))
    try:
        for _ in range(100):  # the first sweep (it wakes the service: its group is new)
            if view.sweeps:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # the watch is armed
        rt.queue.forget((NS, "svc"))
        rt.metric_woken.clear()
        bound.tokens_per_s = 5000.0
        await asyncio.sleep(1.5)
        assert view.sweeps == 1  # no sweep since: only the watch can have seen it
        woken = (NS, "svc") in rt.metric_woken and rt.queue.urgent((NS, "svc"))
        assert woken is (watch_s > 0)
        assert (rt.scraper._watch_conns is not None) is (watch_s > 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
