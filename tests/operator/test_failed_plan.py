"""After a ScalePlan fails (its only target's engine unreachable: the pod is marked unhealthy), the service must
plan again once the engine answers (recovery.py, with a backoff), and say why it cannot while the pool is short:
never decide "0 -> 1" round after round in silence (seen at 2,000 nodes: 110 times in 5 min for one service).

decide() on hand-built Worlds (pure), then the in-process seam: rounds, the plan driver, the fake kube layer and
an engine stub over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from builders import pod, spec
from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime
from test_decide_world import NOW, world

from kascade_operator import labels as L
from kascade_operator import plandriver, recovery
from kascade_operator.handlers import reconcile_service
from kascade_operator.observe import pool_views
from kascade_operator.reconcile import CreatePlan
from kascade_operator.runtime import Runtime

WHY = "engine unreachable for 5 s"
FAILED = {"metadata": {"name": "svc-colocated-x", "namespace": "ns"},
          "spec": {"modelServiceRef": {"name": "svc"}, "role": "colocated",
                   "targets": [{"instance": "e1", "pod": "e1"}]},
          "status": {"phase": "Failed", "message": "no target left"}}
THRESHOLD = {"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}}


def sick(name: str = "e1") -> Any:
    return dataclasses.replace(pod(name, "n1"), unhealthy=WHY)


def test_a_failed_plan_with_a_usable_pod_left_plans_again() -> None:
    d = decide_on([sick(), pod("e2", "n2")])
    assert [a.targets for a in d.actions if isinstance(a, CreatePlan)] == [("e2",)]


def decide_on(pods: list[Any], **kw: Any) -> Any:
    from kascade_operator.decision import decide
    return decide(world(spec(lo=1, hi=2, scaling=THRESHOLD), pods, plans=(FAILED,), **kw))


def test_a_failed_plan_whose_target_is_unhealthy_says_why_once_and_schedules_a_check() -> None:
    # the pool's only other pod is a fallback pod created for the service, not running yet
    pods = [sick(), pod("f1", None, created_for="svc")]
    d = decide_on(pods)
    assert d.actions == () and [(c.current, c.desired) for c in d.changes] == [(0, 1)]
    assert [e.reason for e in d.events] == ["PoolShort"]
    assert f"e1 ({WHY})" in d.events[0].message
    assert d.status is not None
    degraded = next(c for c in d.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PoolShort" and f"e1 ({WHY})" in degraded["message"]
    assert d.health.retry == (("e1", NOW + recovery.HEAL_FIRST_S, recovery.HEAL_FIRST_S),) and d.health.heal == ()
    # the next round, on the status it wrote: the condition stays, the Event is not said again
    again = decide_on(pods, status=dict(d.status), health_retry={"e1": (NOW + 10, 10.0)})
    assert again.events == () and again.health.retry == () and again.status is None


def test_an_unhealthy_engine_is_checked_with_a_backoff_and_healed_when_it_answers() -> None:
    silent = decide_on([sick()], health_retry={"e1": (NOW, 10.0)}, health_checks={"e1": None})
    assert silent.health.retry == (("e1", NOW + 20.0, 20.0),) and silent.health.heal == ()
    capped = decide_on([sick()], health_retry={"e1": (NOW, 250.0)}, health_checks={"e1": None})
    assert capped.health.retry == (("e1", NOW + recovery.HEAL_MAX_S, recovery.HEAL_MAX_S),)
    bound = decide_on([sick()], health_retry={"e1": (NOW, 10.0)}, health_checks={"e1": {"modelService": "svc"}})
    assert bound.health.heal == (("e1", True),)  # still bound to the plan that dropped it: released first
    idle = decide_on([sick()], health_retry={"e1": (NOW, 10.0)}, health_checks={"e1": {"modelService": None}})
    assert idle.health.heal == (("e1", False),)


def test_forbidden_fallback_names_the_unhealthy_pods() -> None:
    d = decide_on([sick()])  # default settings: the operator may not create a pod for this spec
    assert d.blocker is not None and d.blocker.reason == "Forbidden" and f"e1 ({WHY})" in d.blocker.message


# -- the seam ----------------------------------------------------------------------------------------------

NS, TOKEN = "ns", "failed-plan-token"
Seam = tuple[Runtime, FakeKube, EngineStub]


@pytest.fixture
async def seam() -> AsyncIterator[Seam]:
    kube = FakeKube()
    kube.nodes = [{"metadata": {"name": "n0", "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}]
    stub = EngineStub("e0", "tiny", TOKEN, auto_ready=True)
    kube.add_pool_pod(NS, "e0", "n0", stub.endpoint, model="tiny")
    async with stub_runtime(kube, [stub], TOKEN) as rt:
        yield rt, kube, stub


def body(kube: FakeKube) -> dict[str, Any]:
    return {"metadata": {"name": "a", "namespace": NS, "uid": "uid-a", "generation": 1},
            "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 1, "max": 1}}},
            "status": dict(getattr(kube, "service_status", {}))}


async def run_rounds(rt: Runtime, kube: FakeKube, n: int) -> None:
    for _ in range(n):
        rt.last_round.clear()
        await reconcile_service(rt, body(kube), "timer")
        for sp in list(kube.plans.values()):
            if (sp.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                await asyncio.wait_for(plandriver.drive(rt, sp, Stopped()), 20)


def pod_annotations(kube: FakeKube) -> dict[str, str]:
    return dict(kube.pods[(NS, "e0")]["metadata"].get("annotations") or {})


async def test_the_loop_after_a_failed_plan_ends_in_a_new_plan(seam: Seam, monkeypatch: pytest.MonkeyPatch) -> None:
    rt, kube, stub = seam
    monkeypatch.setattr(plandriver, "UNREACHABLE_LIMIT_S", 0.3)
    real_bind = rt.engines.bind

    async def bind_then_go_silent(*a: Any, **kw: Any) -> dict[str, Any]:
        out = await real_bind(*a, **kw)
        stub.fail["status"] = 503  # bound, then its engine stops answering: the plan drops it as unhealthy
        rt.engines.bind = real_bind  # type: ignore[method-assign]
        return out

    rt.engines.bind = bind_then_go_silent  # type: ignore[method-assign]
    await run_rounds(rt, kube, 1)
    plans = list(kube.plans.values())
    assert [p["status"]["phase"] for p in plans] == ["Failed"]
    assert pod_annotations(kube).get(L.UNHEALTHY) == "engine unreachable for 0 s"
    # still silent: rounds decide 0 -> 1 with no pod to bind; they say why (once), and schedule a check
    await run_rounds(rt, kube, 3)
    assert len(kube.plans) == 1
    said = [e for e in kube.events if e["reason"] in ("Forbidden", "PoolShort") and "e0 (engine unreachable" in
            e["message"]]
    assert said, [e["reason"] for e in kube.events]
    stalled = {c["type"]: c for c in kube.service_status["conditions"]}["Stalled"]
    assert stalled["status"] == "True" and "e0 (engine unreachable" in stalled["message"]
    ((_, delay),) = rt.health_retry.values()
    assert delay == recovery.HEAL_FIRST_S
    # the check comes due while the engine is still silent: the backoff doubles
    rt.health_retry[(NS, "e0")] = (0.0, delay)
    await run_rounds(rt, kube, 1)
    assert rt.health_retry[(NS, "e0")][1] == 2 * delay and L.UNHEALTHY in pod_annotations(kube)
    # the engine answers again: healed (released: it still said it was bound), then a new plan binds it
    stub.fail.pop("status")
    rt.health_retry[(NS, "e0")] = (0.0, 2 * delay)
    await run_rounds(rt, kube, 2)
    assert L.UNHEALTHY not in pod_annotations(kube)
    assert any(e["reason"] == "Recovered" for e in kube.events)
    phases = sorted((p["metadata"]["name"], p["status"]["phase"]) for p in kube.plans.values())  # generated in order
    assert [ph for _, ph in phases] == ["Failed", "Succeeded"]
    assert (kube.pods[(NS, "e0")]["metadata"].get("labels") or {}).get(L.MODEL_SERVICE) == "a"


async def test_a_due_check_is_taken_by_one_round_only(seam: Seam) -> None:
    """200 services share one pool: the first round whose check is due asks the engine, the others skip it."""
    rt, kube, _ = seam
    kube.pods[(NS, "e0")]["metadata"]["annotations"][L.UNHEALTHY] = WHY
    rt.health_retry[(NS, "e0")] = (0.0, 10.0)
    pods, _ = await pool_views(rt, NS)
    first = await recovery.checks(rt, pods, NS, 100.0)
    second = await recovery.checks(rt, pods, NS, 100.0)
    assert set(first[0]) == {"e0"} and second[0] == {} and rt.health_retry[(NS, "e0")] == (110.0, 10.0)
