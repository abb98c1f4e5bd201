"""Issue 38 defect 2: a ScalePlan that fails right after it starts must end Failed and leave its ModelService
free to plan again; and a pool pod whose engine holds another model is never bound (in process: the driver
against the in-memory kube layer and real-HTTP engine stubs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.api import ModelServiceSpec
from kascade_operator.handlers import reconcile_service
from kascade_operator.kube import Conflict
from kascade_operator.observe import pool_views
from kascade_operator.reconcile import CreatePlan
from kascade_operator.runtime import Runtime

NS, TOKEN = "ns", "plan-end-token"
World = tuple[Runtime, FakeKube, dict[str, EngineStub]]


def service(name: str, model: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": {"model": {"name": model, "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 1, "max": 2}}}}


@pytest.fixture
async def world() -> AsyncIterator[World]:
    """Three engines of model tiny and one of qwen in one pool, none of them annotated with its model (a pool
    made by hand, or the e2e's EnginePool): only the engines know what they hold."""
    kube = FakeKube()
    kube.nodes = [{"metadata": {"name": f"n{i}", "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}
                  for i in range(2)]
    stubs = {i: EngineStub(i, m, TOKEN, auto_ready=True) for i, m in (("e0", "tiny"), ("e1", "tiny"),
                                                                       ("e2", "tiny"), ("q0", "qwen"))}
    for k, s in enumerate(stubs.values()):
        kube.add_pool_pod(NS, s.instance, f"n{k % 2}", s.endpoint)
    async with stub_runtime(kube, stubs.values(), TOKEN) as rt:
        yield rt, kube, stubs


def phase(kube: FakeKube, name: str) -> str:
    return str((kube.plans[(NS, name)].get("status") or {}).get("phase"))


async def new_plan(rt: Runtime, body: dict[str, Any], target: str) -> dict[str, Any]:
    spec = ModelServiceSpec.model_validate(body["spec"])
    pods, _ = await pool_views(rt, NS)
    sp = await plandriver.new_scaleplan(rt, body, spec, CreatePlan("colocated", (), (target,), "test"),
                                        {p.pod_name: p for p in pods}, await rt.nodes())
    return await rt.kube.create_scaleplan(NS, sp)


async def test_the_fast_path_after_the_driver_failed_the_plan_leaves_it_failed(world: World) -> None:
    """The kopf daemon (drive) sees a new plan before the creating round's fast path (start) runs: it fails the
    plan (its only target refuses the bind), then start instructs from the creation body (no status). Its
    progress write used to land after the terminal one: the plan read Transferring forever, and as its daemon
    had returned nothing ever ended it (3 of 3 two-model runs)."""
    rt, kube, stubs = world
    stubs["e0"].fail["bind"] = 409
    created = await new_plan(rt, service("a", "tiny"), "e0")
    name = created["metadata"]["name"]
    await asyncio.wait_for(plandriver.drive(rt, created, Stopped()), 10)
    assert phase(kube, name) == "Failed"
    binds = stubs["e0"].count("bind")
    await plandriver.start(rt, created, 0.0)  # the creation body: no status at all
    assert phase(kube, name) == "Failed"
    assert stubs["e0"].count("bind") == binds  # a target the plan dropped is never instructed again


async def test_a_progress_write_racing_the_terminal_write_loses(world: World) -> None:
    """The same race with the writes interleaved at the API server: start's bind is in flight when the
    driver's terminal write lands; start's progress write, built before, must not replace it."""
    rt, kube, _ = world
    created = await new_plan(rt, service("a", "tiny"), "e0")
    name = created["metadata"]["name"]
    real_bind = rt.engines.bind

    async def bind_then_fail_the_plan(*a: Any, **kw: Any) -> dict[str, Any]:
        out = await real_bind(*a, **kw)
        await kube.patch_scaleplan_status(NS, name, {"phase": "Failed", "message": "the driver's terminal write"})
        return out

    rt.engines.bind = bind_then_fail_the_plan  # type: ignore[method-assign]
    await plandriver.start(rt, created, 0.0)
    assert phase(kube, name) == "Failed"


async def test_guarded_status_write_conflicts_on_a_stale_version(world: World) -> None:
    rt, kube, _ = world
    created = await new_plan(rt, service("a", "tiny"), "e0")
    name, rv = created["metadata"]["name"], created["metadata"]["resourceVersion"]
    await kube.patch_scaleplan_status(NS, name, {"phase": "Failed"})
    with pytest.raises(Conflict):
        await kube.patch_scaleplan_status(NS, name, {"phase": "Transferring"}, resource_version=rv)
    assert phase(kube, name) == "Failed"


async def test_two_models_unannotated_pool_never_binds_the_other_models_engine(world: World) -> None:
    """A qwen service in a pool whose pods do not say their model: the first pick (e0, by name) holds tiny.
    The operator asks the engine before binding, records what every idle engine holds (kascade.io/model) and
    fails that plan at once; the next round binds q0. No engine is ever asked to bind a model it lacks, and the
    service is never wedged behind a plan that cannot end."""
    rt, kube, stubs = world
    body = service("b", "qwen")
    for _ in range(3):
        await reconcile_service(rt, body, "timer")
        rt.last_round.clear()
        for sp in list(kube.plans.values()):
            if phase(kube, sp["metadata"]["name"]) not in ("Succeeded", "Failed"):
                await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
    bound = [n for (_, n), p in kube.pods.items() if (p["metadata"].get("labels") or {}).get(L.MODEL_SERVICE) == "b"]
    assert bound == ["q0"]
    assert sum(s.refused for s in stubs.values()) == 0  # no bind of a model the engine lacks
    models = {n: (p["metadata"].get("annotations") or {}).get(L.MODEL) for (_, n), p in kube.pods.items()}
    assert models == {"e0": "tiny", "e1": "tiny", "e2": "tiny", "q0": "qwen"}
    first = min(kube.plans.values(), key=lambda p: p["metadata"]["name"])
    assert first["status"]["phase"] == "Failed"
    assert "holds model 'tiny'" in first["status"]["targets"][0]["failed"]


async def test_a_duplicate_plan_of_the_service_that_lost_the_label_leaves_the_engine_to_the_winner(
        world: World) -> None:
    """Two plans of one service on one target (the second made while the watch lagged and the first plan's claim
    had expired, seen at 2,000 nodes under load): B labels the pod first, A's engine bind went through and its
    label write finds the pod B's. A drops the target; it must not release the engine, or B waits for an
    emptied engine forever (the service stuck moving, its pod never loaded)."""
    rt, kube, stubs = world
    body = service("a", "tiny")
    first = await new_plan(rt, body, "e0")
    second = await new_plan(rt, body, "e0")
    await plandriver.start(rt, second, 0.0)  # B binds e0 and labels it
    assert stubs["e0"].model_service == "a"
    binds = stubs["e0"].count("bind")
    await plandriver.start(rt, first, 0.0)  # A: its bind is answered "already bound" and its label is refused
    pod = kube.pods[(NS, "e0")]
    assert pod["metadata"]["annotations"][L.PLAN] == second["metadata"]["name"]
    assert stubs["e0"].count("release") == 0 and stubs["e0"].model_service == "a"
    assert stubs["e0"].count("bind") == binds  # the engine already runs this service's load: no second bind
    await asyncio.wait_for(plandriver.drive(rt, second, Stopped()), 10)
    assert phase(kube, second["metadata"]["name"]) == "Succeeded"
