"""The apply side in process: reconcile rounds and the ScalePlan driver against the in-memory kube layer
(fakekube.py) and real-HTTP engine stubs (enginestub.py), without an operator process."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime

from kascade_operator import labels as L
from kascade_operator import plandriver, rounds
from kascade_operator.api import ModelServiceSpec
from kascade_operator.handlers import apply, queued_round, reconcile_service
from kascade_operator.metricsview import MetricsView
from kascade_operator.pool import pod_view
from kascade_operator.reconcile import Release
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


async def test_pods_released_in_one_round_keep_one_host_copy_per_model(world: Any) -> None:
    """A scale-down drains several pods at once and the next round releases them all from one snapshot of the
    pool: only the first keeps its weights in host memory (host_copies_per_model 1); the others are told
    keepHostCopy false. (Counting from the snapshot alone, every one of them kept a copy.)"""
    rt, kube, stubs = world
    body = service(lo=0)
    spec = ModelServiceSpec.model_validate(body["spec"])
    for s in stubs:
        s.host_cache_bytes, s.model_service, s.phase = 1000, "svc", "serving"
    pods = [dataclasses.replace(pod_view(kube.pods[(NS, s.instance)]), model_service="svc", role="colocated",
                                draining=True, drained=True) for s in stubs]
    for p in list(pods):
        assert await apply(rt, body, spec, pods, Release(p.pod_name), 0.0) is None
    keeping = sorted(n for (_, n), p in kube.pods.items() if p["metadata"]["annotations"].get(L.HOST_COPY) == "tiny")
    assert keeping == ["e0"], keeping
    assert [s.host_copy_bytes for s in stubs] == [1000, 0, 0]
    sent = [next(b for v, b, _ in s.calls if v == "release") for s in stubs]
    assert sent == [{}, {"keepHostCopy": False}, {"keepHostCopy": False}], sent


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


async def _serving_and_a_copy(world: Any) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """One replica serving (its plan driven to the end) and, of the two idle pods, the first recorded as keeping a
    host copy of the model (as a release records it): (its plan, the serving pod, the copy's pod, the other)."""
    _, kube, _ = world
    first, serving = await serving_one(world)
    copy, other = sorted(n for (_, n) in kube.pods if n != serving["metadata"]["name"])
    await kube.patch_pod(NS, copy, {"metadata": {"annotations": {L.HOST_COPY: "tiny"}}})
    return first, serving, copy, other


async def test_a_host_copy_sends_as_a_source_and_is_never_bound(world: Any) -> None:
    """An idle pod keeping the model in host memory is a plan source (kind host): the driver sends it the
    load plan, binds only the target, and the pod stays idle with its kascade.io/host-copy annotation; while
    the plan runs no other service's plan takes it."""
    rt, kube, stubs = world
    first, serving, copy, other = await _serving_and_a_copy(world)
    next(s for s in stubs if s.instance == copy).host_copy_bytes = 1000  # and its engine keeps it (status)
    rt.last_round.clear()
    await reconcile_service(rt, service(lo=2), "update")
    (sp,) = [p for p in kube.plans.values() if p["metadata"]["name"] != first["metadata"]["name"]]
    srcs = {s["pod"]: s for s in sp["spec"]["sources"]}
    assert srcs[copy]["kind"] == "host" and srcs[copy]["hostCopy"] is True
    assert srcs[serving["metadata"]["name"]]["kind"] == "gpu"
    assert [t["pod"] for t in sp["spec"]["targets"]] == [other]
    stub = {s.instance: s for s in stubs}
    assert stub[copy].count("load-plan") == 1 and stub[copy].count("bind") == 0  # sends, is not bound
    # another service of the same model, while the plan runs: the copy is held, not its first copy
    await reconcile_service(rt, service("svc2", lo=1), "create")
    assert all(t["pod"] != copy for p in kube.plans.values() for t in p["spec"]["targets"])
    await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Succeeded"
    meta = kube.pods[(NS, copy)]["metadata"]
    assert L.MODEL_SERVICE not in meta["labels"] and meta["annotations"][L.HOST_COPY] == "tiny"
    assert stub[copy].count("bind") == 0 and stub[copy].model_service is None
    assert sorted(p["metadata"]["name"] for p in bound_pods(kube)) == sorted([serving["metadata"]["name"], other])


async def test_a_host_copy_source_without_a_copy_loses_its_record(world: Any) -> None:
    rt, kube, stubs = world
    _, _, copy, _ = await _serving_and_a_copy(world)
    stub = {s.instance: s for s in stubs}
    stub[copy].fail["load-plan"] = 400  # its engine restarted: no copy (status hostCopyBytes 0), no manifest
    rt.last_round.clear()
    await reconcile_service(rt, service(lo=2), "update")
    assert stub[copy].count("load-plan") == 1
    assert kube.pods[(NS, copy)]["metadata"]["annotations"].get(L.HOST_COPY) is None  # never named again


async def test_a_scale_from_zero_keeps_the_host_copy_it_binds_from(world: Any) -> None:
    """The first replica binds from e1's host copy; the engine keeps the copy while it serves, so the pod keeps
    its kascade.io/host-copy annotation, and no other engine is asked for one."""
    rt, kube, stubs = world
    e1 = stubs[1]
    e1.host_cache_bytes = e1.host_copy_bytes = 1000
    kube.pods[(NS, "e1")]["metadata"]["annotations"][L.HOST_COPY] = "tiny"
    await reconcile_service(rt, service(), "create")
    (bound,) = bound_pods(kube)
    assert bound["metadata"]["name"] == "e1"
    assert next(b for v, b, _ in e1.calls if v == "bind")["source"] == {"hostCopy": True}
    assert bound["metadata"]["annotations"].get(L.HOST_COPY) == "tiny"
    e1.phase = "serving"
    await reconcile_service(rt, service(), "update")
    assert [s.count("host-copy") for s in stubs] == [0, 0, 0]  # the pool keeps one: nobody is asked


async def test_a_service_with_no_host_copy_asks_one_serving_engine_once(world: Any) -> None:
    """Loaded from the model source, the service has no host copy: the operator asks one ready engine (the
    oldest name) to keep one; the next rounds see its annotation and ask nobody. An engine without a budget
    declines: its pod is marked and the next engine is asked, once."""
    rt, kube, stubs = world
    for s in stubs:
        s.model_service, s.role, s.phase = "svc", "colocated", "serving"
        meta = kube.pods[(NS, s.instance)]["metadata"]
        meta["labels"].update({L.MODEL_SERVICE: "svc", L.ROLE: "colocated", L.POOL: L.POOL_BOUND})
        meta["annotations"][L.LOADED] = "true"
    stubs[1].host_cache_bytes, stubs[2].host_cache_bytes = 1000, 1000  # e0: no --host-cache-gib
    body = service(lo=3)
    for _ in range(3):
        await reconcile_service(rt, body, "timer")
        rt.last_round.clear()  # the service's interval: every call is a round
    assert [s.count("host-copy") for s in stubs] == [1, 1, 0]
    ann = {n: p["metadata"]["annotations"] for (_, n), p in kube.pods.items()}
    assert ann["e0"].get(L.HOST_COPY_REFUSED) == "tiny" and not ann["e0"].get(L.HOST_COPY)
    assert ann["e1"].get(L.HOST_COPY) == "tiny" and not ann["e2"].get(L.HOST_COPY)
    assert [s.host_copy_bytes for s in stubs] == [0, 1000, 0]
    assert {"kind": "host", "location": "e1", "node": "n1"} in kube.service_status["sources"]
    assert [e["reason"] for e in kube.events if e["reason"].startswith("HostCopy")] == ["HostCopyRefused", "HostCopy"]


async def test_a_copy_lost_with_its_engine_is_forgotten_and_made_again(world: Any) -> None:
    """e1 is recorded as keeping the copy, but its engine restarted (hostCopyBytes 0): the operator reads it,
    clears the record, and the next round asks a serving engine to keep one."""
    rt, kube, stubs = world
    for s in stubs[::2]:
        s.model_service, s.role, s.phase, s.host_cache_bytes = "svc", "colocated", "serving", 1000
        meta = kube.pods[(NS, s.instance)]["metadata"]
        meta["labels"].update({L.MODEL_SERVICE: "svc", L.ROLE: "colocated", L.POOL: L.POOL_BOUND})
        meta["annotations"][L.LOADED] = "true"
    kube.pods[(NS, "e1")]["metadata"]["annotations"][L.HOST_COPY] = "tiny"  # stubs[1].host_copy_bytes is 0
    body = service(lo=2, hi=2)
    await reconcile_service(rt, body, "timer")
    assert kube.pods[(NS, "e1")]["metadata"]["annotations"].get(L.HOST_COPY) is None
    assert [s.count("host-copy") for s in stubs] == [0, 0, 0]
    rt.last_round.clear()
    await reconcile_service(rt, body, "timer")
    assert [s.count("host-copy") for s in stubs] == [1, 0, 0]
    assert kube.pods[(NS, "e0")]["metadata"]["annotations"].get(L.HOST_COPY) == "tiny"
    assert [e["reason"] for e in kube.events if e["reason"].startswith("HostCopy")] == ["HostCopyLost", "HostCopy"]
    rt.last_round.clear()
    await reconcile_service(rt, body, "timer")  # e0's copy is read (it keeps it) and nothing else happens
    assert [s.count("host-copy") for s in stubs] == [1, 0, 0]
    assert kube.pods[(NS, "e0")]["metadata"]["annotations"].get(L.HOST_COPY) == "tiny"


async def test_a_scale_down_keeps_its_host_copy_on_the_released_pod_not_the_serving_one(world: Any) -> None:
    """Issue 40: two replicas serve from the model source (no host copy yet) and `desired` drops to one. The
    round that drains e1 must not ask the serving e0 for a copy (the keeper ran 45 ms after the drain, saw no
    released copy yet, and e0 kept one; e1's release was then told to drop its weights), nor must a later round
    while e1 is still draining (its release answered 409: requests in flight). e1's release keeps the copy."""
    rt, kube, stubs = world
    _serving(kube, stubs[:2])
    body = service(lo=1, hi=3, replicas={"colocated": {"min": 1, "max": 3}, "desired": 1})
    await reconcile_service(rt, body, "update")  # the drain round: e1 (the newest name) is drained
    assert L.DRAINING in kube.pods[(NS, "e1")]["metadata"]["annotations"]
    assert [s.count("host-copy") for s in stubs] == [0, 0, 0]
    stubs[1].fail["release"] = 409  # requests still in flight on e1: the release waits a round
    rt.last_round.clear()
    await reconcile_service(rt, body, "timer")
    assert stubs[1].count("release") == 1 and [s.count("host-copy") for s in stubs] == [0, 0, 0]
    del stubs[1].fail["release"]
    for _ in range(2):
        rt.last_round.clear()
        await reconcile_service(rt, body, "timer")  # e1 released (keeping its weights), then a quiet round
    ann = {n: p["metadata"]["annotations"] for (_, n), p in kube.pods.items()}
    assert ann["e1"].get(L.HOST_COPY) == "tiny" and not ann["e0"].get(L.HOST_COPY), ann
    assert [s.host_copy_bytes for s in stubs] == [0, 1000, 0]
    assert [s.count("host-copy") for s in stubs] == [0, 0, 0]
    assert next(b for v, b, _ in reversed(stubs[1].calls) if v == "release") == {}  # not told to drop them


def _serving(kube: FakeKube, stubs: list[EngineStub]) -> None:
    """These engines serve svc (loaded from the model source: no host copy), each with a host-cache budget."""
    for s in stubs:
        s.model_service, s.role, s.phase, s.host_cache_bytes = "svc", "colocated", "serving", 1000
        meta = kube.pods[(NS, s.instance)]["metadata"]
        meta["labels"].update({L.MODEL_SERVICE: "svc", L.ROLE: "colocated", L.POOL: L.POOL_BOUND})
        meta["annotations"][L.LOADED] = "true"


async def test_a_scale_down_after_the_keeper_ran_moves_the_copy_to_the_released_pod(world: Any) -> None:
    """Issue 40, the other order: a round saw both replicas ready before `desired` dropped, so e0 already keeps
    the keeper's copy while it serves. e1's release still keeps one (a serving copy does not count), and e0 then
    drops its own: the same outcome as when the scale-down came first, one copy, on the released pod."""
    rt, kube, stubs = world
    _serving(kube, stubs[:2])
    await reconcile_service(rt, service(lo=2, hi=3), "timer")
    assert [s.host_copy_bytes for s in stubs] == [1000, 0, 0]  # the keeper's stopgap on e0 (oldest name)
    body = service(lo=1, hi=3, replicas={"colocated": {"min": 1, "max": 3}, "desired": 1})
    for _ in range(3):  # drain e1; release it (keeping its weights) and drop e0's copy; a quiet round
        rt.last_round.clear()
        await reconcile_service(rt, body, "timer")
    ann = {n: p["metadata"]["annotations"] for (_, n), p in kube.pods.items()}
    assert ann["e1"].get(L.HOST_COPY) == "tiny" and not ann["e0"].get(L.HOST_COPY), ann
    assert [s.host_copy_bytes for s in stubs] == [0, 1000, 0]
    assert next(b for v, b, _ in stubs[1].calls if v == "release") == {}  # not told to drop its weights
    assert [b for v, b, _ in stubs[0].calls if v == "host-copy"] == [{"keep": True}, {"keep": False}]
    assert stubs[0].model_service == "svc"  # e0 serves on
    assert [e["reason"] for e in kube.events if e["reason"].startswith("HostCopy")] == ["HostCopy", "HostCopyDropped"]


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
