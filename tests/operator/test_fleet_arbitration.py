"""The fleet's arbitration in the operator's round, as pure parts: hand-built Worlds of services sharing one pool
-> decide() -> each service's post on the board -> the board's arbitration -> decide() again: growth capped at
the grant, preempted replicas drained for the service that ranks first, never below min, not within the
hysteresis, at most max_preemptions, status and Events saying why. Bad priorities are refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from builders import pod, spec
from pydantic import ValidationError

from kascade_operator.api import ModelServiceSpec
from kascade_operator.decision import decide
from kascade_operator.fleetboard import FleetBoard
from kascade_operator.observe import field_errors
from kascade_operator.pool import PodView
from kascade_operator.reconcile import CreatePlan, CreatePods, Drain
from kascade_operator.settings import OperatorSettings
from kascade_operator.snapshots import group_pool
from kascade_operator.world import Decision, RoleWorld, World
from kascade_planner import policies as P
from kascade_planner.arbitration import ArbitrationConfig

T0 = 1000.0
CFG = ArbitrationConfig(hysteresis_s=30.0, max_preemptions=2)


def svc(priority: int, lo: int = 1, hi: int = 6) -> ModelServiceSpec:
    return spec(lo=lo, hi=hi, scaling={"policy": "concurrency", "concurrency": {"targetPerInstance": 4},
                                       "scaleDownDelaySeconds": 60, "priority": priority})


def bound(name: str, n: int, ready: bool = True, **kw: Any) -> list[PodView]:
    return [pod(f"{name}{i}", f"{name}-n{i}", ms=name, role="colocated", ready=ready, **kw) for i in range(n)]


def world(name: str, s: ModelServiceSpec, pods: list[PodView], now: float, in_flight: int,
          loads: dict[str, float], board: FleetBoard | None, free: int = 0, status: Any = None) -> World:
    body = {"metadata": {"name": name, "namespace": "ns", "uid": "u-" + name, "generation": 1}, "spec": {},
            "status": status or {}}
    snap = P.MetricsSnapshot(now, in_flight=in_flight)
    mine = [p for p in pods if p.model_service in (None, name)]
    fleet = board.view(name, free, now, CFG) if board is not None else None
    promised = group_pool([{} for _ in pods], pods).preempted
    return World(body, "timer", now, "2026-12-06T10:00:00Z", OperatorSettings(engine_token="t"), s, pool_ns="ns",
                 key=name, pods=tuple(mine), roles=(RoleWorld("colocated", snap, last_busy_s=now, loads=loads),),
                 fleet=fleet, promised=promised)


def post_all(board: FleetBoard, *decisions: tuple[str, Decision]) -> None:
    for name, d in decisions:
        assert d.post is not None
        board.post(name, d.post)


def test_priority_is_a_non_negative_integer_and_the_error_names_the_field() -> None:
    sc = svc(7).scaling
    assert sc is not None and sc.priority == 7
    assert spec().scaling is None  # no scaling block: class 0
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValidationError) as e:
            svc(bad)  # type: ignore[arg-type]
        assert "spec.scaling.priority" in field_errors(e.value)


def test_a_higher_class_takes_the_least_loaded_replica_of_an_idle_lower_class_never_below_min() -> None:
    a, b = svc(5), svc(0, lo=1)
    pods = bound("a", 1) + bound("b", 3)
    b_loads = {"b0": 3.0, "b1": 0.0, "b2": 1.0}
    # first rounds: each posts its ask (A wants 3 for 10 in flight; B holds 3 for 12)
    board = FleetBoard()
    da = decide(world("a", a, pods, T0, 10, {"a0": 10.0}, None))
    db = decide(world("b", b, pods, T0, 12, b_loads, None))
    post_all(board, ("a", da), ("b", db))
    assert board.short(free=0) and not board.short(free=2)
    # within the hysteresis (B's replicas first seen bound at T0) nothing is taken
    early = decide(world("b", b, pods, T0 + 5, 12, b_loads, board))
    assert not [x for x in early.actions if isinstance(x, Drain)]
    # later: B gives its idle replica, then its least loaded; A waits for them and creates no pods
    now = T0 + 60
    db2 = decide(world("b", b, pods, now, 12, b_loads, board))
    drains = [x for x in db2.actions if isinstance(x, Drain)]
    assert drains == [Drain("b1", "a"), Drain("b2", "a")]
    assert db2.status is not None and db2.status["arbitration"]["preempted"] == ["b1", "b2"]
    assert db2.status["arbitration"]["rankedAbove"] == ["a"]
    assert {e.reason for e in db2.events} >= {"Preempted", "Arbitrated"}
    cond = next(c for c in db2.status["conditions"] if c["type"] == "Arbitrated")
    assert (cond["status"], cond["reason"]) == ("True", "Preempted")
    da2 = decide(world("a", a, pods, now, 10, {"a0": 10.0}, board))
    assert not [x for x in da2.actions if isinstance(x, CreatePods | CreatePlan)]
    assert da2.wake == ("b",) and "arbitrated" in da2.moving
    # the drains are under way: A counts them as coming (promised), B holds its last replica (min 1)
    draining = bound("a", 1) + [pod("b0", "b-n0", ms="b", role="colocated", ready=True)] + \
        [pod(f"b{i}", f"b-n{i}", ms="b", role="colocated", ready=True, draining=True) for i in (1, 2)]
    draining = [p if p.pod_name in ("a0", "b0") else _preempted(p, "a") for p in draining]
    da3 = decide(world("a", a, draining, now + 1, 10, {"a0": 10.0}, board))
    db3 = decide(world("b", b, draining, now + 1, 4, {"b0": 3.0}, board))
    post_all(board, ("a", da3), ("b", db3))
    assert da3.post is not None and da3.post.entries[0].current == 3  # one serving + two coming
    assert db3.post is not None and db3.post.entries[0].current == 1
    db4 = decide(world("b", b, draining, now + 2, 4, {"b0": 3.0}, board))
    assert not [x for x in db4.actions if isinstance(x, Drain)]  # never below min
    # released: A binds them (the pool now has two idle engines, the arbitration grants them to A)
    released = bound("a", 1) + bound("b", 1) + [pod("b1", "b-n1"), pod("b2", "b-n2")]
    da5 = decide(world("a", a, released, now + 5, 10, {"a0": 10.0}, board, free=2))
    plans = [x for x in da5.actions if isinstance(x, CreatePlan)]
    assert len(plans) == 1 and set(plans[0].targets) == {"b1", "b2"} and plans[0].sources == ("a0",)


def _preempted(p: PodView, taker: str) -> PodView:
    from dataclasses import replace
    return replace(p, preempted_for=taker)


def test_an_equal_class_does_not_take_from_a_busy_peer_and_gets_less_with_reason() -> None:
    a, b = svc(0), svc(0)
    pods = bound("a", 2) + bound("b", 2)
    board = FleetBoard()
    post_all(board, ("a", decide(world("a", a, pods, T0, 16, {"a0": 8.0, "a1": 8.0}, None))),
             ("b", decide(world("b", b, pods, T0, 8, {"b0": 4.0, "b1": 4.0}, None))))
    da = decide(world("a", a, pods, T0 + 60, 16, {"a0": 8.0, "a1": 8.0}, board))
    db = decide(world("b", b, pods, T0 + 60, 8, {"b0": 4.0, "b1": 4.0}, board))
    assert not [x for x in db.actions if isinstance(x, Drain)]
    # nobody ranked above A: it is not capped, and the pool being empty it falls back to creating pods as
    # before (here refused by the installation's pod policy, which says so)
    assert da.status is not None and da.status["arbitration"]["granted"] == 2
    assert da.status["arbitration"]["rankedAbove"] == []
    assert da.result is not None and da.result.short == 2 and "creating 2" in da.result.notes[0]


def test_at_most_max_preemptions_per_arbitration_and_a_lone_service_never_arbitrates() -> None:
    a, b = svc(9, hi=8), svc(0, lo=0, hi=8)
    pods = bound("a", 1) + bound("b", 6)
    b_loads = {f"b{i}": 0.0 for i in range(6)}
    board = FleetBoard()
    post_all(board, ("a", decide(world("a", a, pods, T0, 32, {"a0": 32.0}, None))),
             ("b", decide(world("b", b, pods, T0, 24, b_loads, None))))
    db = decide(world("b", b, pods, T0 + 60, 24, b_loads, board))
    assert len([x for x in db.actions if isinstance(x, Drain)]) == CFG.max_preemptions
    alone = FleetBoard()
    alone.post("a", board.posts["a"])
    assert alone.view("a", 0, T0 + 60, CFG).arbitration is None


def test_the_arbitration_is_computed_once_per_version_of_the_board() -> None:
    a, b = svc(5), svc(0)
    pods = bound("a", 1) + bound("b", 3)
    board = FleetBoard()
    post_all(board, ("a", decide(world("a", a, pods, T0, 10, {"a0": 10.0}, None))),
             ("b", decide(world("b", b, pods, T0, 4, {"b0": 4.0}, None))))
    v1 = board.view("a", 0, T0 + 60, CFG).arbitration
    assert v1 is not None and board.view("b", 0, T0 + 60.5, CFG).arbitration is v1  # shared, not recomputed
    assert board.view("b", 1, T0 + 60.5, CFG).arbitration is not v1  # the free engines changed
    version = board.version
    post_all(board, ("b", decide(world("b", b, pods, T0, 4, {"b0": 4.0}, None))))  # the same ask: no change
    assert board.version == version and board.donors("a") == ["b"] and board.donors("b") == []
    board.remove("b")
    assert board.version == version + 1 and board.growth == 2 and not board.short(0)


async def test_a_release_behind_the_pods_version_unbinds_at_its_current_one() -> None:
    """The round's view of a draining pod is a version behind (its gate and Ready changed): the unbind reads
    it again and goes through, rather than waiting a round per 409; a pod that changed hands is left alone."""
    from fakekube import FakeKube

    from kascade_operator.actuator import unbind
    from kascade_operator.kube import now_iso
    from kascade_operator.pool import bind_patch, drain_patch, pod_view

    kube = FakeKube()
    kube.add_pool_pod("ns", "p", "n0", "127.0.0.1:1")
    await kube.patch_pod("ns", "p", bind_patch(pod_view(kube.pods[("ns", "p")]), "b", "colocated", "plan-1"))
    await kube.patch_pod("ns", "p", drain_patch(pod_view(kube.pods[("ns", "p")]), now_iso(), "a"))
    stale = pod_view(kube.pods[("ns", "p")])
    await kube.patch_pod("ns", "p", {"metadata": {"annotations": {"x": "1"}}})  # e.g. a gate write meanwhile
    rt: Any = type("Rt", (), {"kube": kube})()
    assert await unbind(rt, "ns", stale, None)
    meta = kube.pods[("ns", "p")]["metadata"]
    assert "kascade.io/model-service" not in meta["labels"] and "kascade.io/preempted-for" not in meta["annotations"]
    assert not await unbind(rt, "ns", stale, None)  # no longer bound to b: nothing done
