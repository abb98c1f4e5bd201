"""Scale-up onto a node whose cache keeps the model's copy, in process (issue 35 item 3): reconcile rounds and the
ScalePlan driver against the in-memory kube layer and real-HTTP engine stubs (test_apply_seam's `world`). A
target there binds with source.nodeCopy and gets no load plan; a node whose engine refuses it is streamed to."""

from __future__ import annotations

import asyncio
from typing import Any

import test_apply_seam as seam
from enginestub import EngineStub
from stubruntime import Stopped
from test_apply_seam import NS, TOKEN, bound_pods, service

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.api import ModelServiceSpec
from kascade_operator.handlers import reconcile_service
from kascade_operator.pool import pod_view
from kascade_operator.reconcile import CreatePlan

world = seam.world  # the fixture: three engine stubs on n0..n2, the in-memory kube, a Runtime


async def _a_copy_node_with_an_idle_engine(world: Any) -> tuple[dict[str, Any], str, str, EngineStub]:
    """One replica serving (its plan driven to the end) that maps its node's copy of the model (annotation and
    engine status), an idle engine "e3" added on that node, the node cache on: (its plan, the serving pod, its
    node, e3's stub; the caller closes it)."""
    rt, kube, stubs = world
    first, serving = await seam.serving_one(world)
    name, node = serving["metadata"]["name"], serving["spec"]["nodeName"]
    await kube.patch_pod(NS, name, {"metadata": {"annotations": {L.HOST_COPY: "tiny"}}})  # it maps the node's copy
    next(s for s in stubs if s.instance == name).host_copy_bytes = 1000  # and its engine says so (status)
    extra = EngineStub("e3", "tiny", TOKEN)
    kube.add_pool_pod(NS, "e3", node, extra.endpoint, model="tiny")
    rt.settings = rt.settings.model_copy(update={"node_cache": True})
    return first, name, node, extra


async def test_a_target_on_a_node_keeping_the_copy_binds_from_it_and_no_plan_streams(world: Any) -> None:
    """Node cache on (issue 35 item 3): the serving replica's node keeps the model's copy, so the next replica goes
    to an idle engine of that node (fleettargets) and binds from the copy (source.nodeCopy): the ScalePlan marks
    it nodeCopy and no engine is sent a load plan."""
    rt, kube, stubs = world
    first, name, _, extra = await _a_copy_node_with_an_idle_engine(world)
    try:
        loads = sum(s.count("load-plan") for s in stubs)
        rt.last_round.clear()
        await reconcile_service(rt, service(lo=2), "update")
        (sp,) = [p for p in kube.plans.values() if p["metadata"]["name"] != first["metadata"]["name"]]
        assert [(t["pod"], t.get("nodeCopy")) for t in sp["spec"]["targets"]] == [("e3", True)], sp["spec"]
        assert sp["spec"]["algorithm"] == "local" and sp["spec"]["predictedSeconds"] > 0
        assert next(b for v, b, _ in extra.calls if v == "bind")["source"] == {"nodeCopy": True}
        await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
        assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Succeeded"
        assert extra.count("load-plan") == 0 and sum(s.count("load-plan") for s in stubs) == loads
        assert sorted(p["metadata"]["name"] for p in bound_pods(kube)) == sorted([name, "e3"])
    finally:
        extra.close()


async def test_a_refused_node_copy_drops_the_target_and_the_next_plan_streams_to_it(world: Any) -> None:
    """The engine on the copy node answers 409 to source.nodeCopy (no usable copy there, or no node cache): the
    target is dropped and the next plan to a target on that node sends it the blocks, not nodeCopy again."""
    rt, kube, _ = world
    first, name, node, extra = await _a_copy_node_with_an_idle_engine(world)
    try:
        extra.fail["bind"] = 409
        rt.last_round.clear()
        await reconcile_service(rt, service(lo=2), "update")
        (sp,) = [p for p in kube.plans.values() if p["metadata"]["name"] != first["metadata"]["name"]]
        assert [(t["pod"], t.get("nodeCopy")) for t in sp["spec"]["targets"]] == [("e3", True)]
        await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 10)
        assert kube.plans[(NS, sp["metadata"]["name"])]["status"]["phase"] == "Failed"
        assert rt.node_copy_refused.keys() == {(node, "tiny")}
        # the next plan for a target on that node streams to it (for NODE_COPY_RETRY_S), then tries the copy again
        pods = {v.pod_name: v for v in (pod_view(x) for x in kube.pods.values())}
        body = service(lo=2)
        spec = ModelServiceSpec.model_validate(body["spec"])
        action = CreatePlan("colocated", (name,), ("e3",), "up")
        doc = await plandriver.new_scaleplan(rt, body, spec, action, pods, kube.nodes)
        assert [(t["pod"], t.get("nodeCopy")) for t in doc["spec"]["targets"]] == [("e3", None)]
        assert [f["dst"] for f in doc["spec"]["plan"]["flows"]] == [pods["e3"].instance]
        rt.node_copy_refused[(node, "tiny")] -= plandriver.NODE_COPY_RETRY_S
        doc = await plandriver.new_scaleplan(rt, body, spec, action, pods, kube.nodes)
        assert [(t["pod"], t.get("nodeCopy")) for t in doc["spec"]["targets"]] == [("e3", True)]
    finally:
        extra.close()
