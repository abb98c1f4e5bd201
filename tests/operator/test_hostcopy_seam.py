"""Host copies in the apply seam (test_apply_seam's `world`: the in-memory kube layer, real-HTTP engine stubs, a
Runtime): pods released in one round keep one copy per model, a copy sends as a plan source and is never bound, a
stale copy loses its record, a scale from zero keeps the copy it binds from, a service without a copy asks one
serving engine once, a copy lost with its engine is made again, and a scale-down keeps the copy on the released
pod, whichever of the keeper and the release runs first."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import test_apply_seam as seam
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped
from test_apply_seam import NS, bound_pods, service, serving_one

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.api import ModelServiceSpec
from kascade_operator.handlers import apply, reconcile_service
from kascade_operator.pool import pod_view
from kascade_operator.reconcile import Release

world = seam.world  # the fixture: three engine stubs on n0..n2, the in-memory kube, a Runtime


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

