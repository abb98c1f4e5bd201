"""Pure reconciler, production cases: many models in one pool, expectations (no pod storm), per-role
desired counts, status conditions (kstatus), and the policy for pods the operator may create."""

from __future__ import annotations

from typing import Any

import pytest
from builders import pod, spec

from kascade_operator.decide import RoleInput, decide_roles
from kascade_operator.podtemplate import checkpoint_path, fallback_pod, refusals
from kascade_operator.reconcile import CreatePlan, CreatePods, reconcile
from kascade_operator.settings import OperatorSettings
from kascade_operator.status import Blocker, invalid_status, kstatus, plan_conditions, service_status
from kascade_planner.policies import MetricsSnapshot


def test_targets_are_always_for_the_right_model() -> None:
    pods = [pod("a", "n1", model="llama"), pod("b", "n2", model="qwen"), pod("c", "n3")]  # c: any model
    res = reconcile("q", spec(model="qwen", lo=2, hi=4), pods, [])
    assert res.actions[0] == CreatePlan("colocated", (), ("b", "c"), "colocated: 0 -> 2 replicas")
    res = reconcile("l", spec(model="llama", lo=1, hi=4), pods, [], {"colocated": 3})
    plan = next(a for a in res.actions if isinstance(a, CreatePlan))
    assert "b" not in plan.targets and set(plan.targets) == {"a", "c"}


def test_fallback_pods_belong_to_the_service_they_were_created_for() -> None:
    pods = [pod("f1", "n1", model="m", created_for="other")]
    res = reconcile("svc", spec(lo=1), pods, [])
    assert CreatePods("colocated", 1) in res.actions  # another service's fallback pod is not ours


def test_expectations_create_exactly_the_missing_pods_once() -> None:
    s = spec(lo=3, hi=4)
    first = reconcile("svc", s, [], [])
    assert first.actions == (CreatePods("colocated", 3),) and first.short == 3
    # created but not yet in the watch: expected, nothing more is created
    assert reconcile("svc", s, [], [], expected=3).actions == ()
    # in the watch, pending (no node) and unschedulable: still counted; the pool is exhausted
    pending = [pod(f"f{i}", None, created_for="svc", unschedulable=True) for i in range(3)]
    again = reconcile("svc", s, pending, [])
    assert again.actions == () and again.exhausted and again.coming == 3
    # one got a node and is Ready: it is bound, the other two are still awaited
    pending[0] = pod("f0", "n1", created_for="svc")
    third = reconcile("svc", s, pending, [])
    assert third.actions == (CreatePlan("colocated", (), ("f0",), "colocated: 0 -> 3 replicas"),)


def test_disaggregated_roles_have_their_own_desired_count() -> None:
    s = spec("disaggregated", lo=1, hi=4, replicas={"prefill": {"min": 1, "max": 4, "desired": 3},
                                                     "decode": {"min": 1, "max": 4}})
    idle = [pod(f"p{i}", f"n{i}") for i in range(5)]
    res = reconcile("svc", s, idle, [])
    counts = {a.role: len(a.targets) for a in res.actions if isinstance(a, CreatePlan)}
    assert counts == {"prefill": 3, "decode": 1}
    rnd = decide_roles(s, [RoleInput("prefill", 1, 1, 4, MetricsSnapshot(0.0)),
                           RoleInput("decode", 1, 1, 4, MetricsSnapshot(0.0))], "timer")
    assert [d.policy for d in rnd.decisions] == ["scaleSubresource", "tokenVelocity"]
    assert rnd.decisions[0].desired == 3 and "prefill" not in rnd.desired


def test_scale_subresource_total_splits_across_roles_in_disaggregated_mode() -> None:
    s = spec("disaggregated", lo=1, hi=4, desired=6)
    idle = [pod(f"p{i}", f"n{i}") for i in range(8)]
    res = reconcile("svc", s, idle, [])
    counts = {a.role: len(a.targets) for a in res.actions if isinstance(a, CreatePlan)}
    assert counts == {"prefill": 3, "decode": 3}


def _conds(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_status_conditions_follow_kstatus() -> None:
    s = spec(lo=1, hi=4)
    ready = [pod("r", "n0", "svc", "colocated", ready=True)]
    res = reconcile("svc", s, ready, [])
    st = service_status("svc", "svc", res, ready, [], 3)
    c = _conds(st)
    assert (c["Ready"]["status"], c["Reconciling"]["status"], c["Stalled"]["status"]) == ("True", "False", "False")
    assert all({"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"} <= set(x)
               for x in st["conditions"])
    assert kstatus({"metadata": {"generation": 3}, "status": st}) == "Current"
    assert kstatus({"metadata": {"generation": 4}, "status": st}) == "InProgress"  # status is stale

    short = reconcile("svc", spec(lo=2, hi=4), ready, [])  # pool empty: Degraded PoolShort
    st2 = service_status("svc", "svc", short, ready, [], 3)
    assert _conds(st2)["Degraded"]["status"] == "True"
    assert kstatus({"metadata": {"generation": 3}, "status": st2}) == "InProgress"

    exhausted = reconcile("svc", spec(lo=2, hi=4), [*ready, pod("f", None, created_for="svc", unschedulable=True)], [])
    st3 = service_status("svc", "svc", exhausted, ready, [], 3)
    assert _conds(st3)["Stalled"]["reason"] == "PoolExhausted"
    assert kstatus({"metadata": {"generation": 3}, "status": st3}) == "Failed"

    forbidden = service_status("svc", "svc", short, ready, [], 3, Blocker("Forbidden", "spec.engine.image: no"))
    assert _conds(forbidden)["Stalled"]["message"] == "spec.engine.image: no"
    bad = invalid_status("spec.engine.tp: too big", 5)
    assert kstatus({"metadata": {"generation": 5}, "status": bad}) == "Failed"
    assert _conds(bad)["Ready"]["status"] == "False"


def test_plan_conditions() -> None:
    live = {c["type"]: c["status"] for c in plan_conditions("Transferring", "", 1)}
    assert live == {"Ready": "False", "Reconciling": "True", "Stalled": "False"}
    failed = {c["type"]: c["status"] for c in plan_conditions("Failed", "x", 1)}
    assert failed == {"Ready": "False", "Reconciling": "False", "Stalled": "True"}


@pytest.mark.parametrize(("source", "image", "settings", "fields"), [
    ({"path": "/models/m"}, "kascade:1", {"engine_image": "kascade:1", "allowed_host_path_roots": ["/models"]}, []),
    ({"path": "/"}, "kascade:1", {"engine_image": "kascade:1", "allowed_host_path_roots": ["/models"]},
     ["spec.model.source.path"]),
    ({"path": "/models/../etc"}, "kascade:1", {"engine_image": "kascade:1", "allowed_host_path_roots": ["/models"]},
     ["spec.model.source.path"]),
    ({"path": "/models/m"}, "kascade:1", {"engine_image": "kascade:1"}, ["spec.model.source.path"]),  # none allowed
    ({"uri": "file:///data/m"}, "evil:latest", {"engine_image": "kascade:1", "allowed_host_path_roots": ["/models"]},
     ["spec.engine.image", "spec.model.source.uri"]),
    ({"pvc": {"claimName": "models"}}, "registry.local/kascade:2",
     {"engine_image": "kascade:1", "allowed_images": ["registry.local/*"]}, []),
])
def test_what_the_operator_refuses_to_create(source: dict[str, Any], image: str, settings: dict[str, Any],
                                             fields: list[str]) -> None:
    s = spec(model={"name": "m", "source": source}, engine={"image": image})
    got = refusals(s, OperatorSettings(**settings))
    assert [g.split(":")[0] for g in got] == fields


def test_fallback_pod_mounts_pvc_and_is_owned() -> None:
    s = spec(model={"name": "m", "source": {"pvc": {"claimName": "weights", "subPath": "m1"}}})
    owner = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "name": "svc", "uid": "u1",
             "controller": True, "blockOwnerDeletion": True}
    p = fallback_pod(s, "svc", "tok", owner)
    vol = p["spec"]["volumes"][0]
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    c = p["spec"]["containers"][0]
    assert c["volumeMounts"][0]["subPath"] == "m1" and f"--checkpoint={checkpoint_path(s)}" in c["args"]
    assert p["metadata"]["ownerReferences"] == [owner]
    assert p["metadata"]["annotations"] == {"kascade.io/model": "m", "kascade.io/created-for": "svc"}
    assert "hostPath" not in str(p)
