"""decision.decide as a pure function: hand-built Worlds in, every decision kind's values out (no kube, no
engines, no event loop)."""

from __future__ import annotations

import dataclasses
from typing import Any

from builders import pod, spec

from kascade_operator.api import ModelServiceSpec
from kascade_operator.decision import decide
from kascade_operator.demand import Demand
from kascade_operator.reconcile import CreatePlan, CreatePods, Drain, Release
from kascade_operator.settings import OperatorSettings
from kascade_operator.world import CopyWork, Event, RoleWorld, World
from kascade_planner import policies as P

NOW = 1000.0
CONC = {"policy": "concurrency", "concurrency": {"targetPerInstance": 4}, "scaleDownDelaySeconds": 0}


def world(s: ModelServiceSpec | None, pods: Any = (), snap: P.MetricsSnapshot | None = None, status: Any = None,
          **kw: Any) -> World:
    body = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u1", "generation": 3},
            "spec": {}, "status": status or {}}
    roles = kw.pop("roles", None)
    if roles is None and s is not None:
        roles = tuple(RoleWorld(r, snap or P.MetricsSnapshot(NOW), last_busy_s=NOW)
                      for r in (("colocated",) if s.mode == "colocated" else ("prefill", "decode")))
    settings = kw.pop("settings", OperatorSettings(engine_token="t"))
    return World(body, kw.pop("trigger", "timer"), NOW, "2026-12-06T08:00:00Z", settings, s,
                 pool_ns="ns", key="svc", pods=tuple(pods), roles=roles or (), **kw)


def serving(n: int, **kw: Any) -> list[Any]:
    return [pod(f"s{i}", f"n{i}", ms="svc", role="colocated", ready=True, **kw) for i in range(n)]


def idle(n: int) -> list[Any]:
    return [pod(f"i{i}", f"m{i}") for i in range(n)]


def test_a_refused_spec_is_reported_once_per_generation() -> None:
    d = decide(world(None, problems=("spec.replicas: Field required",)))
    assert d.events == (Event("Warning", "InvalidSpec", "spec.replicas: Field required"),)
    assert d.invalid_generation == 3 and d.result is None and d.actions == ()
    assert d.status is not None
    stalled = next(c for c in d.status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "InvalidSpec")
    again = decide(world(None, problems=("spec.replicas: Field required",), invalid_reported=True))
    assert again.status is None and again.events == () and again.invalid_generation is None


def test_load_above_the_target_creates_one_plan_from_the_ready_copy() -> None:
    s = spec(hi=4, scaling=CONC)
    d = decide(world(s, serving(1) + idle(3), P.MetricsSnapshot(NOW, in_flight=10)))
    assert [(c.current, c.desired, c.policy) for c in d.changes] == [(1, 3, "concurrency")]
    assert len(d.actions) == 1 and isinstance(d.actions[0], CreatePlan)
    plan = d.actions[0]
    assert plan.sources == ("s0",) and len(plan.targets) == 2 and set(plan.targets) <= {"i0", "i1", "i2"}
    assert d.status is not None and d.status["lastDecision"]["to"] == 3
    assert d.status["lastDecision"]["time"] == "2026-12-06T08:00:00Z"
    assert {"actions", "changes", "progressing"} <= set(d.moving)


def test_pods_other_rounds_claimed_or_other_plans_hold_are_never_targets() -> None:
    s = spec(hi=4, scaling=CONC)
    d = decide(world(s, serving(1) + idle(3), P.MetricsSnapshot(NOW, in_flight=10), held=frozenset({"i1"}),
                     reserved=frozenset({"i0"})))
    assert [a.targets for a in d.actions if isinstance(a, CreatePlan)] == [("i2",)]
    assert d.result is not None and d.result.short == 1


def test_a_set_desired_count_turns_the_policy_off() -> None:
    s = spec(hi=4, desired=2, scaling=CONC)
    d = decide(world(s, serving(1) + idle(2), P.MetricsSnapshot(NOW, in_flight=100)))
    assert [(c.desired, c.policy) for c in d.changes] == [(2, "scaleSubresource")]
    assert [len(a.targets) for a in d.actions if isinstance(a, CreatePlan)] == [1]


def test_low_load_drains_the_newest_and_a_drained_pod_is_released() -> None:
    s = spec(lo=1, hi=4, scaling=CONC)
    d = decide(world(s, serving(3), P.MetricsSnapshot(NOW, in_flight=1)))
    assert d.actions == (Drain("s2"), Drain("s1"))
    drained = [*serving(1), pod("s1", "n1", ms="svc", role="colocated", ready=True, draining=True, drained=True)]
    d2 = decide(world(s, drained, P.MetricsSnapshot(NOW, in_flight=1)))
    assert d2.actions == (Release("s1"),) and "draining" in d2.moving


def test_an_empty_pool_creates_pods_unless_the_pod_policy_refuses() -> None:
    s = spec(lo=2, hi=4)
    allowed = OperatorSettings(engine_token="t", engine_image="kascade/engine:dev", allowed_host_path_roots=["/models"])
    d = decide(world(s, (), settings=allowed))
    assert d.actions == (CreatePods("colocated", 2),) and d.blocker is None and d.events == ()
    strict = OperatorSettings(engine_token="t", engine_image="registry.example/kascade:1",
                              allowed_host_path_roots=["/models"])
    d2 = decide(world(s, (), settings=strict))
    assert d2.actions == () and d2.blocker is not None and d2.blocker.reason == "Forbidden"
    assert [e.reason for e in d2.events] == ["Forbidden"]
    assert d2.status is not None
    stalled = next(c for c in d2.status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "Forbidden")


def test_min_zero_releases_the_last_copy_after_the_idle_time_and_comes_back_on_demand() -> None:
    s = spec(lo=0, hi=2, scaling={"idleReleaseSeconds": 60})
    quiet = (RoleWorld("colocated", P.MetricsSnapshot(NOW), last_busy_s=NOW - 61),)
    d = decide(world(s, serving(1), roles=quiet, router=True, demand=Demand()))
    assert d.actions == (Drain("s0"),) and "releaseLast" in d.moving
    assert d.clocks["colocated"][1] == NOW - 61  # idle: the busy clock is not moved
    wanted = (RoleWorld("colocated", P.MetricsSnapshot(NOW), last_busy_s=NOW - 600),)
    d2 = decide(world(s, idle(1), roles=wanted, router=True, demand=Demand(queued=3, requests_per_s=2.0)))
    assert [c.desired for c in d2.changes] == [1]
    assert [a.targets for a in d2.actions if isinstance(a, CreatePlan)] == [("i0",)] and len(d2.actions) == 1
    assert d2.clocks["colocated"][1] == NOW  # busy now


def test_a_steady_service_writes_nothing_and_waits_for_the_resync() -> None:
    s = spec(lo=1, hi=4, scaling=CONC)
    pods = [dataclasses.replace(p, host_copy="m") for p in serving(1)]  # the pool keeps a copy: nothing to ask
    first = decide(world(s, pods, P.MetricsSnapshot(NOW, in_flight=2)))
    assert first.actions == () and first.moving == () and first.status is not None
    again = decide(world(s, pods, P.MetricsSnapshot(NOW, in_flight=2), status=dict(first.status)))
    assert again.status is None and again.moving == ()


def test_host_copies_a_lost_record_is_cleared_before_anything_else() -> None:
    s = spec(lo=1, hi=4, scaling=CONC)
    pods = serving(2)
    d = decide(world(s, pods, P.MetricsSnapshot(NOW, in_flight=5)))
    assert d.copies == CopyWork(ask="s0") and "hostCopyAsked" in d.moving  # the oldest ready one is asked
    kept = [dataclasses.replace(pods[0], host_copy="m"), pods[1]]
    assert decide(world(s, kept, P.MetricsSnapshot(NOW, in_flight=5))).copies == CopyWork()
    lost = decide(world(s, kept, P.MetricsSnapshot(NOW, in_flight=5), copy_checks={"s0": 0}))
    assert lost.copies == CopyWork(lost=("s0",))


def test_finished_plans_beyond_the_history_limit_are_pruned_oldest_first() -> None:
    s = spec(lo=1, hi=4, scaling=CONC, scalePlanHistoryLimit=1)
    plans = tuple({"metadata": {"name": f"p{i}", "creationTimestamp": f"2026-12-06T0{i}:00:00Z"},
                   "spec": {"modelServiceRef": {"name": "svc"}, "role": "colocated", "targets": [{"pod": "s0"}]},
                   "status": {"phase": "Succeeded", "completionTime": f"2026-12-06T0{i}:00:01Z"}} for i in (3, 1, 2))
    d = decide(world(s, serving(1), P.MetricsSnapshot(NOW, in_flight=2), plans=plans))
    assert d.prune == ("p1", "p2")


def test_the_serving_gate_follows_the_binding() -> None:
    raw = {"metadata": {"name": "s0", "labels": {"kascade.io/pool": "true", "kascade.io/model-service": "svc"},
                        "annotations": {"kascade.io/loaded": "true"}},
           "spec": {"readinessGates": [{"conditionType": "kascade.io/serving"}]},
           "status": {"conditions": [{"type": "kascade.io/serving", "status": "False"}]}}
    d = decide(world(spec(scaling=CONC), serving(1), P.MetricsSnapshot(NOW, in_flight=2), raw_pods=(raw,)))
    assert d.gates == (("s0", True),) and d.labels == (("s0", True),)


def test_a_spec_update_or_resume_round_holds_what_the_policy_holds() -> None:
    """A round triggered by a spec edit (kopf update) or an operator restart (resume) keeps the replicas the
    policy holds: it used to fall back to min and drain a loaded service."""
    s = spec(lo=1, hi=4, scaling=CONC)
    for trigger in ("timer", "update", "resume"):
        d = decide(world(s, serving(3), P.MetricsSnapshot(NOW, in_flight=12), trigger=trigger))
        assert [(c.current, c.desired) for c in d.decisions] == [(3, 3)] and d.actions == (), trigger
