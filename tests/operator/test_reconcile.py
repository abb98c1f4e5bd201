"""Pure reconciler: table of observations -> exact actions; idempotence and bounds."""

from __future__ import annotations

import pytest
from builders import pod, spec

from kascade_operator.reconcile import CreatePlan, CreatePods, Drain, PlanView, Release, reconcile

IDLE = [pod("p-a", "n1", leaf="l0"), pod("p-b", "n2", leaf="l1"), pod("p-c", "n3", leaf="l0")]


@pytest.mark.parametrize(("case", "pods", "plans", "desired", "expect"), [
    ("empty service binds min from the pool, local load", IDLE, [], None,
     [CreatePlan("colocated", (), ("p-a",), "colocated: 0 -> 1 replicas")]),
    ("at min: nothing to do", [pod("s", "n0", "svc", "colocated", ready=True), *IDLE], [], None, []),
    ("scale up picks leaf-local targets first", [pod("s", "n0", "svc", "colocated", ready=True, leaf="l1"), *IDLE],
     [], {"colocated": 3}, [CreatePlan("colocated", ("s",), ("p-b", "p-a"), "up")]),
    ("desired clamped to max", [pod("s", "n0", "svc", "colocated", ready=True), *IDLE], [], {"colocated": 99},
     [CreatePlan("colocated", ("s",), ("p-a", "p-c", "p-b"), "up")]),
    ("pool too small -> slow fallback for the rest", [pod("s", "n0", "svc", "colocated", ready=True), IDLE[0]], [],
     {"colocated": 4}, [CreatePlan("colocated", ("s",), ("p-a",), "up"), CreatePods("colocated", 2)]),
    ("a running plan blocks a new one", [pod("s", "n0", "svc", "colocated", ready=True), *IDLE],
     [PlanView("svc-1", "colocated", "Transferring", ("p-a",))], {"colocated": 3}, []),
    ("finished plan does not block", [pod("s", "n0", "svc", "colocated", ready=True), *IDLE],
     [PlanView("svc-1", "colocated", "Succeeded", ("x",))], {"colocated": 2},
     [CreatePlan("colocated", ("s",), ("p-a",), "up")]),
    ("scale down drains the not-ready first", [pod("r1", ms="svc", role="colocated", ready=True),
                                               pod("r2", ms="svc", role="colocated", ready=True),
                                               pod("l1", ms="svc", role="colocated")], [], {"colocated": 1},
     [Drain("l1"), Drain("r2")]),
    ("drained pod is released", [pod("r1", ms="svc", role="colocated", ready=True),
                                 pod("r2", ms="svc", role="colocated", ready=True, draining=True, drained=True)],
     [], {"colocated": 1}, [Release("r2")]),
])
def test_reconcile_table(case: str, pods: list, plans: list, desired: dict | None, expect: list) -> None:
    res = reconcile("svc", spec(lo=1, hi=4), pods, plans, desired, reason="up" if desired else "")
    assert list(res.actions) == expect, case


def test_never_drains_last_ready_copy_even_at_min_zero() -> None:
    pods = [pod("only", ms="svc", role="colocated", ready=True)]
    res = reconcile("svc", spec(lo=0, hi=2), pods, [], {"colocated": 0})
    assert res.actions == ()


def test_idempotent_on_same_observation() -> None:
    pods = [pod("s", "n0", "svc", "colocated", ready=True), *IDLE]
    a = reconcile("svc", spec(), pods, [], {"colocated": 3}, "r")
    b = reconcile("svc", spec(), pods, [], {"colocated": 3}, "r")
    assert a == b


def test_disaggregated_roles_do_not_share_targets() -> None:
    res = reconcile("svc", spec(mode="disaggregated", lo=1, hi=2), IDLE[:2], [], None)
    plans = [a for a in res.actions if isinstance(a, CreatePlan)]
    assert [p.role for p in plans] == ["prefill", "decode"]
    assert set(plans[0].targets).isdisjoint(plans[1].targets)
    assert res.roles["prefill"].desired == 1 and not res.available


def test_status_counts() -> None:
    pods = [pod("r", ms="svc", role="colocated", ready=True), pod("l", ms="svc", role="colocated")]
    res = reconcile("svc", spec(lo=2, hi=4), pods, [], None)
    assert (res.roles["colocated"].ready, res.roles["colocated"].loading, res.available) == (1, 1, True)


def test_pods_other_services_took_are_never_targets() -> None:
    pods = [pod("s", "n0", "svc", "colocated", ready=True, leaf="l1"), *IDLE]
    res = reconcile("svc", spec(lo=1, hi=4), pods, [], {"colocated": 3}, reason="up", unavailable={"p-b"})
    assert list(res.actions) == [CreatePlan("colocated", ("s",), ("p-a", "p-c"), "up")]
    res = reconcile("svc", spec(lo=1, hi=4), pods, [], {"colocated": 3}, reason="up", unavailable={"p-a", "p-b", "p-c"})
    assert list(res.actions) == [CreatePods("colocated", 2)]  # nothing left: the slow path, never a shared pod
