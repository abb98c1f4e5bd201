"""ModelServiceRole: one scale subresource per role of a disaggregated ModelService, so HPA/KEDA (or
`kubectl scale`) drive prefill and decode separately. Pure resolution and status, then the operator as a
real process on the real API server scaling one role through the object's /scale endpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import spec
from enginestub import EngineStub

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for
from kascade_operator.decide import RoleInput, decide_roles
from kascade_operator.reconcile import role_want
from kascade_operator.roleobject import (
    RoleObject,
    effective,
    resolve,
    role_status,
    status_differs,
    with_role_counts,
)
from kascade_planner.policies import MetricsSnapshot

TOKEN = "role-test-token"


def obj(
    name: str, role: str, replicas: int | None, svc: str = "svc", created: str = "2026-01-01T00:00:00Z"
) -> RoleObject:
    return RoleObject(name, svc, role, replicas, 1, created)


def test_the_role_object_sets_that_roles_count_and_turns_its_policy_off() -> None:
    s = spec("disaggregated", lo=1, hi=4)
    res = resolve("svc", "disaggregated", [obj("svc-prefill", "prefill", 3), obj("other", "decode", 2, svc="x")])
    assert set(res.active) == {"prefill"} and not res.refused  # another service's object is not ours
    s2, sources = with_role_counts(s, res)
    assert s2.replicas.prefill is not None and s2.replicas.prefill.desired == 3
    assert s2.replicas.decode is not None and s2.replicas.decode.desired is None
    assert s.replicas.prefill is not None and s.replicas.prefill.desired is None  # the input is not changed
    rnd = decide_roles(s2, [RoleInput("prefill", 1, 1, 4, MetricsSnapshot(0.0)),
                            RoleInput("decode", 1, 1, 4, MetricsSnapshot(0.0))], "timer", sources=sources)
    pre, dec = rnd.decisions
    assert pre.policy == "scaleSubresource" and pre.desired == 3 and "ModelServiceRole svc-prefill" in pre.reason
    assert dec.policy != "scaleSubresource"


def test_replicas_outside_the_roles_bounds_are_clamped_and_said() -> None:
    s = spec("disaggregated", lo=1, hi=4)
    res = resolve("svc", "disaggregated", [obj("p", "prefill", 9)])
    s2, sources = with_role_counts(s, res)
    assert s2.replicas.prefill is not None and s2.replicas.prefill.desired == 4
    assert "clamped" in sources["prefill"]
    st = role_status(obj("p", "prefill", 9), "sel", 4, 4, None, effective(s, obj("p", "prefill", 9)), [], "t0")
    assert st["effectiveReplicas"] == 4 and {c["type"]: c["reason"] for c in st["conditions"]}["Ready"] == "Clamped"


def test_an_unset_count_leaves_the_policy_in_charge() -> None:
    s = spec("disaggregated", lo=1, hi=4)
    s2, sources = with_role_counts(s, resolve("svc", "disaggregated", [obj("p", "prefill", None)]))
    assert s2 == s and sources == {}
    assert role_want(s2, "prefill", s2.replicas.prefill) is None  # type: ignore[arg-type]


def test_a_second_object_for_one_role_and_a_colocated_service_are_refused_naming_the_field() -> None:
    res = resolve("svc", "disaggregated", [obj("late", "prefill", 2, created="2026-01-02T00:00:00Z"),
                                           obj("early", "prefill", 3)])
    assert res.active["prefill"].name == "early" and res.refused["late"].startswith("spec.role:")
    res = resolve("svc", "colocated", [obj("p", "prefill", 2)])
    assert not res.active and res.refused["p"].startswith("spec.modelServiceRef.name:")


def test_status_keeps_transition_times_and_is_not_rewritten_when_equal() -> None:
    o = obj("p", "prefill", 2)
    first = role_status(o, "sel", 1, 1, None, 2, [], "t0")
    again = role_status(o, "sel", 1, 1, None, 2, first["conditions"], "t1")
    assert again == first and not status_differs(first, again)
    grown = role_status(o, "sel", 2, 2, None, 2, first["conditions"], "t2")
    assert status_differs(first, grown) and grown["conditions"][0]["lastTransitionTime"] == "t0"


# --- the operator on the real API server --------------------------------------------------------------

def _get(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def _role_pods(cp: ControlPlane, ns: str, role: str) -> list[dict[str, Any]]:
    return _get(cp, ns, "pods", "-l", f"kascade.io/model-service=svc,kascade.io/role={role}")["items"]



@pytest.mark.cluster
def test_kubectl_scale_of_a_role_object_scales_that_role_alone(
        control_plane: ControlPlane, namespace: str, op: OperatorProcess, kwok_nodes: Callable[..., list[str]]) -> None:
    cp, ns = control_plane, namespace
    example = Path(__file__).resolve().parents[2] / "examples" / "hpa-per-role.yaml"
    out = cp.kubectl("-n", ns, "apply", "--dry-run=server", "-f", str(example)).stdout  # the CRD and HPA v2 accept it
    assert out.count("created (server dry run)") == 4, out
    nodes = kwok_nodes(6, leaves=2)
    stubs = []
    for i, node in enumerate(nodes):
        s = EngineStub(f"e{i}", "tiny", TOKEN)
        stubs.append(s)
        cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"e{i}", "labels": {"kascade.io/pool": "warm"},
                          "annotations": {"kascade.io/endpoint": s.endpoint,
                                          "kascade.io/data-endpoint": f"127.0.0.1:{21000 + i}"}},
             "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "kascade:dev"}],
                      "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]}}))
    try:
        op.start()
        svc = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "svc"},
               "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 4},
                        "engine": {"image": "kascade:dev"}, "mode": "disaggregated",
                        "replicas": {"prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 3}},
                        "scaling": {"policy": "threshold", "intervalSeconds": 0.2, "scaleDownDelaySeconds": 0.5,
                                    "threshold": {"metric": "tokensPerSecond", "upper": 2000, "lower": 500}}}}
        cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(svc))
        wait_for(lambda: len(_role_pods(cp, ns, "prefill")) == 1 and len(_role_pods(cp, ns, "decode")) == 1,
                 timeout=60, what="min of each role bound")
        role = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelServiceRole", "metadata": {"name": "svc-prefill"},
                "spec": {"modelServiceRef": {"name": "svc"}, "role": "prefill"}}
        cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(role))
        # what an HPA does: PUT the object's /scale (kubectl scale uses the same subresource)
        cp.kubectl("-n", ns, "scale", "msvcrole", "svc-prefill", "--replicas=3")
        wait_for(lambda: len(_role_pods(cp, ns, "prefill")) == 3, timeout=60, what="prefill scaled to 3 by its object")
        scale = json.loads(cp.kubectl("get", "--raw", f"/apis/kascade.io/v1alpha1/namespaces/{ns}/modelserviceroles/"
                                      "svc-prefill/scale").stdout)
        assert scale["spec"]["replicas"] == 3
        st = wait_for(lambda: (s := _get(cp, ns, "msvcrole", "svc-prefill").get("status") or {}).get("replicas") == 3
                      and s, timeout=30, what="the role object's status.replicas")
        assert st["selector"] == "kascade.io/model-service=svc,kascade.io/role=prefill"
        assert {c["type"]: c["status"] for c in st["conditions"]} == {"Ready": "True", "Stalled": "False"}
        assert len(_role_pods(cp, ns, "decode")) == 1  # the other role is untouched
        # a second object for the same role, and one for a service that does not exist: refused, field named
        for name, target in (("svc-prefill-2", "svc"), ("ghost-prefill", "ghost")):
            cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(
                {**role, "metadata": {"name": name}, "spec": {"modelServiceRef": {"name": target}, "role": "prefill",
                                                             "replicas": 1}}))
        for name, field in (("svc-prefill-2", "spec.role:"), ("ghost-prefill", "spec.modelServiceRef.name:")):
            conds = wait_for(lambda n=name: {c["type"]: c for c in
                                             (_get(cp, ns, "msvcrole", n).get("status") or {}).get("conditions") or []},
                             timeout=30, what=f"{name} refused")
            assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["message"].startswith(field)
        assert len(_role_pods(cp, ns, "prefill")) == 3  # the refused object (replicas 1) changed nothing
        # unset spec.replicas: the policy is back in charge (no load: prefill down to its min)
        cp.kubectl("-n", ns, "patch", "msvcrole", "svc-prefill", "--type=json",
                   "-p", json.dumps([{"op": "remove", "path": "/spec/replicas"}]))
        wait_for(lambda: len(_role_pods(cp, ns, "prefill")) == 1, timeout=60, what="policy back: prefill to min")
    finally:
        for s in stubs:
            s.close()
