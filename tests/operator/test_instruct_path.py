"""The scale-up's instruct path (issue 33: the reaction's round trips): the manifest the plan's build read is not
asked again, the targets' status and bind run beside the sources' load plans (each target's load plan after
them), a new plan's free target whose pod names its model is bound without a status read first, and the
creating round does not wait for the watch to show its plan.

Real-HTTP engine stand-ins (enginestub.py) and the in-memory kube layer (fakekube.py); every assertion is on
what the stand-ins received."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.handlers import reconcile_service
from kascade_operator.instruction import instruct_pending
from kascade_operator.runtime import Runtime

NS, TOKEN = "ns", "path-token"
MANIFEST = {b: {"bytes": 1 << 20, "digest": f"d-{b}"} for b in ("embed", "layer.0", "layer.1", "head")}


@pytest.fixture
async def world() -> AsyncIterator[tuple[Runtime, FakeKube, list[EngineStub]]]:
    kube = FakeKube()
    kube.nodes = [{"metadata": {"name": f"n{i}", "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                                            "kascade.io/scaleup-domain": f"d{i}"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}
                  for i in range(3)]
    stubs = [EngineStub(f"e{i}", "tiny", TOKEN, auto_ready=True) for i in range(3)]
    for i, s in enumerate(stubs):
        kube.add_pool_pod(NS, s.instance, f"n{i}", s.endpoint, model="tiny")
    async with stub_runtime(kube, stubs, TOKEN) as rt:
        yield rt, kube, stubs


def service(lo: int) -> dict[str, Any]:
    return {"metadata": {"name": "svc", "namespace": NS, "uid": "uid-svc", "generation": 1},
            "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": lo, "max": 3}}}}


async def plan(kube: FakeKube, gpus: int = 1) -> dict[str, Any]:
    """A transfer plan from e0 (serving svc) into e1, as the API server returned it at its creation."""
    kube.pods[(NS, "e0")]["metadata"]["labels"][L.MODEL_SERVICE] = "svc"
    target = {"instance": "e1", "pod": "e1", **({"gpus": gpus} if gpus > 1 else {})}
    return await kube.create_scaleplan(NS, {
        "metadata": {"name": "svc-colocated-x", "namespace": NS,
                     "ownerReferences": [{"kind": "ModelService", "name": "svc", "uid": "uid-svc"}]},
        "spec": {"modelServiceRef": {"name": "svc"}, "role": "colocated", "algorithm": "chain",
                 "sources": [{"instance": "e0", "node": "n0"}], "targets": [target],
                 "plan": {"model": {"name": "tiny"}, "targets": [target]}}})


def verbs(stub: EngineStub, verb: str) -> list[tuple[dict[str, Any], float]]:
    return [(b, t) for v, b, t in list(stub.calls) if v == verb]


async def test_a_scale_up_asks_its_source_for_the_manifest_once(world: Any) -> None:
    rt, kube, stubs = world
    for s in stubs:
        s.manifest = MANIFEST
    await reconcile_service(rt, service(lo=1), "create")  # the first replica loads from its node: no source
    (src,) = [s for s in stubs if s.model_service == "svc"]
    (first,) = kube.plans.values()
    await asyncio.wait_for(plandriver.drive(rt, first, Stopped()), 10)  # it serves: a source now
    rt.last_round.clear()
    await reconcile_service(rt, service(lo=2), "update")  # the second from the first
    assert [b for b, _ in verbs(src, "manifest")] == [{"parts": 1}]  # the build's; the instruct asked again
    (target,) = [s for s in stubs if s is not src and verbs(s, "load-plan")]
    assert verbs(target, "load-plan")[0][0]["manifest"] == MANIFEST  # what the build read is what targets get


async def test_an_engine_without_a_manifest_is_not_asked_twice_either(world: Any) -> None:
    rt, kube, stubs = world
    sp = await plan(kube)
    await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: None})  # the build's answer: 404
    assert verbs(stubs[0], "manifest") == [] and len(verbs(stubs[0], "load-plan")) == 1
    assert "manifest" not in verbs(stubs[1], "load-plan")[0][0]


async def test_tp_targets_still_get_the_manifest_with_their_parts(world: Any) -> None:
    rt, kube, stubs = world
    stubs[0].manifest = MANIFEST
    sp = await plan(kube, gpus=2)
    await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: {"embed": {}}})  # a tp-1 read
    assert [b for b, _ in verbs(stubs[0], "manifest")] == [{"parts": 2}]
    assert verbs(stubs[1], "load-plan")[0][0]["manifest"] == MANIFEST


async def test_targets_bind_beside_the_sources_load_plans_and_load_after_them(world: Any) -> None:
    rt, kube, stubs = world
    stubs[0].delay["load-plan"] = 0.5  # a slow source
    sp = await plan(kube)
    await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: None})
    ((_, t_src),) = verbs(stubs[0], "load-plan")
    ((_, t_bind),) = verbs(stubs[1], "bind")
    ((_, t_load),) = verbs(stubs[1], "load-plan")
    assert t_bind < t_src + 0.5  # bound while the source's load plan was being answered (was: after it)
    assert t_load >= t_src + 0.5  # its own load plan after the source has its plan, as before
    assert kube.plans[(NS, "svc-colocated-x")]["status"]["targets"] == [{"instance": "e1", "instructed": True}]


async def test_the_creating_round_does_not_wait_for_the_watch_and_makes_no_second_plan(world: Any) -> None:
    rt, kube, _stubs = world
    rt.plan_index = {NS: []}  # a watch that lags: it never shows the plan during this test
    t0 = time.monotonic()
    await reconcile_service(rt, service(lo=1), "create")
    assert time.monotonic() - t0 < 2.0  # the round polled the index for up to 2 s, holding the service's key
    assert len(kube.plans) == 1
    for _ in range(3):  # the next rounds read the plan from the operator's own record of it
        rt.last_round.clear()
        await reconcile_service(rt, service(lo=1), "timer")
    assert len(kube.plans) == 1


async def test_a_new_plans_target_is_bound_without_reading_its_status_first(world: Any) -> None:
    rt, kube, stubs = world
    sp = await plan(kube)
    await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: None})
    assert verbs(stubs[1], "status") == [] and len(verbs(stubs[1], "bind")) == 1  # was: status, then bind
    assert kube.plans[(NS, "svc-colocated-x")]["status"]["targets"] == [{"instance": "e1", "instructed": True}]


async def test_a_target_whose_engine_is_not_as_its_pod_says_is_read_and_switched(world: Any) -> None:
    rt, kube, stubs = world
    stubs[1].model = "other"  # its pod still says tiny: the first bind is refused, the status shows why
    sp = await plan(kube)
    rt.service_index = {(NS, "svc"): [service(lo=1)]}  # spec.model.source.path: the switch's checkpoint
    await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: None})
    binds = [b for b, _ in verbs(stubs[1], "bind")]
    assert len(binds) == 2 and "modelPath" not in binds[0] and binds[1]["modelPath"] == "/models/tiny"
    assert len(verbs(stubs[1], "status")) == 1 and stubs[1].model == "tiny" and stubs[1].switched == 1
    assert kube.plans[(NS, "svc-colocated-x")]["status"]["targets"] == [{"instance": "e1", "instructed": True}]


async def test_a_plan_made_elsewhere_still_reads_the_targets_status_first(world: Any) -> None:
    rt, kube, stubs = world
    sp = await plan(kube)
    await instruct_pending(rt, sp, created=False, manifests={stubs[0].endpoint: None})  # another operator's plan
    (t_status,), (t_bind,) = [t for _, t in verbs(stubs[1], "status")], [t for _, t in verbs(stubs[1], "bind")]
    assert t_status <= t_bind  # an earlier incarnation may have bound it: the status says so


async def test_a_target_that_refuses_its_load_plan_with_409_is_dropped_not_counted_instructed(world: Any) -> None:
    rt, kube, stubs = world
    stubs[1].fail["load-plan"] = 409  # another plan's load runs there (the same plan again would be a 200)
    sp = await plan(kube)
    drops = await instruct_pending(rt, sp, created=True, manifests={stubs[0].endpoint: None})
    assert set(drops) == {"e1"} and "load plan refused" in drops["e1"] and "409" in drops["e1"], drops
    assert {"instance": "e1", "instructed": True} not in kube.plans[(NS, "svc-colocated-x")]["status"]["targets"]
