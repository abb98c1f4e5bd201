"""Arbitration across models (kascade_planner.arbitration): priority, SLO pressure, fair share, floors, hysteresis."""

from __future__ import annotations

import itertools

import pytest

from kascade_planner.arbitration import ArbitrationConfig, Replica, ServiceAsk, arbitrate


def reps(service: str, n: int, load: float = 0.0, bound_s: float = 0.0) -> list[Replica]:
    return [Replica(f"{service}-{i}", service, load, bound_s) for i in range(n)]


def test_enough_engines_everyone_gets_its_ask_and_nobody_is_preempted() -> None:
    asks = [ServiceAsk("a", 1, 3), ServiceAsk("b", 2, 2), ServiceAsk("c", 3, 1)]
    out = arbitrate(asks, reps("a", 1) + reps("b", 2) + reps("c", 3), free=0, now=100.0)
    # c shrinks by 2: those engines are a's growth
    assert [(g.service, g.granted, g.reason) for g in out.grants] == [("a", 3, ""), ("b", 2, ""), ("c", 1, "")]
    assert out.preemptions == () and out.free_left == 0


def test_priority_class_wins_then_the_lower_class_says_why() -> None:
    asks = [ServiceAsk("batch", 0, 3, priority=0), ServiceAsk("chat", 0, 3, priority=10)]
    out = arbitrate(asks, [], free=4, now=0.0)
    assert out.grant("chat").granted == 3 and out.grant("batch").granted == 1
    reason = out.grant("batch").reason
    assert "asked 3, granted 1" in reason and "chat" in reason and "priority 0" in reason


def test_slo_pressure_before_fair_share_within_a_class() -> None:
    asks = [ServiceAsk("calm", 1, 4, pressure=0.5), ServiceAsk("late", 1, 4, pressure=2.5)]
    out = arbitrate(asks, [], free=3, now=0.0)
    # late's pressure per replica: 2.5, 1.25 (pressured: it gets both), 0.83; then fair share (calm 1, late 3)
    assert out.grant("late").granted == 3 and out.grant("calm").granted == 2
    out = arbitrate(asks, [], free=2, now=0.0)
    assert out.grant("late").granted == 3 and out.grant("calm").granted == 1
    assert "ranked first: late" in out.grant("calm").reason


def test_fair_share_by_weight_when_nothing_else_differs() -> None:
    asks = [ServiceAsk("a", 0, 10, weight=1.0), ServiceAsk("b", 0, 10, weight=2.0), ServiceAsk("c", 0, 10)]
    out = arbitrate(asks, [], free=8, now=0.0)
    assert [out.grant(n).granted for n in "abc"] == [2, 4, 2]


def test_preempts_idle_replica_of_a_lower_class_above_its_min_never_below() -> None:
    asks = [ServiceAsk("hot", 1, 4, priority=5, pressure=2.0), ServiceAsk("idle", 3, 3, min=1)]
    replicas = [*reps("hot", 1, load=8), Replica("idle-0", "idle", 3.0, 0.0), Replica("idle-1", "idle", 0.0, 0.0),
                Replica("idle-2", "idle", 1.0, 0.0)]
    out = arbitrate(asks, replicas, free=0, now=100.0)
    assert [p.replica for p in out.preemptions] == ["idle-1", "idle-2"]  # idle first, then least loaded
    assert out.grant("idle").granted == 1 and out.grant("idle").preempted == ("idle-1", "idle-2")
    assert out.grant("hot").granted == 3 and "asked 4, granted 3" in out.grant("hot").reason
    assert "at its min" in out.grant("idle").reason and "hot" in out.grant("idle").reason
    assert all("priority 5 above 0" in p.reason for p in out.preemptions)


def test_a_replica_bound_recently_is_not_preempted() -> None:
    asks = [ServiceAsk("hot", 0, 2, priority=1), ServiceAsk("b", 2, 2)]
    replicas = [Replica("b-old", "b", 0.0, 0.0), Replica("b-new", "b", 0.0, 90.0)]
    out = arbitrate(asks, replicas, free=0, now=100.0, cfg=ArbitrationConfig(hysteresis_s=30.0))
    assert [p.replica for p in out.preemptions] == ["b-old"]
    assert out.grant("hot").granted == 1


def test_equals_do_not_take_from_each_other_below_fair_share() -> None:
    # same class, both unpressured, b holds 2 and a 1: moving one would leave b with 1 < a's 2 -> no preemption
    asks = [ServiceAsk("a", 1, 3), ServiceAsk("b", 2, 2)]
    out = arbitrate(asks, reps("a", 1) + reps("b", 2), free=0, now=100.0)
    assert out.preemptions == () and out.grant("a").granted == 1
    # b holds 4: it gives one (3 >= 2), then no more (2 < 3)
    asks = [ServiceAsk("a", 1, 3), ServiceAsk("b", 4, 4)]
    out = arbitrate(asks, reps("a", 1) + reps("b", 4), free=0, now=100.0)
    assert [p.donor for p in out.preemptions] == ["b"] and out.grant("a").granted == 2


def test_a_growing_service_gives_nothing_and_higher_classes_are_never_donors() -> None:
    asks = [ServiceAsk("a", 2, 5, priority=0, pressure=3.0), ServiceAsk("b", 2, 4, priority=0),
            ServiceAsk("vip", 2, 2, priority=9)]
    out = arbitrate(asks, reps("a", 2) + reps("b", 2) + reps("vip", 2), free=0, now=100.0)
    assert out.preemptions == ()
    assert out.grant("a").granted == 2 and out.grant("vip").granted == 2


def test_busy_peers_do_not_trade_replicas_but_a_model_with_none_gets_one() -> None:
    asks = [ServiceAsk("a", 1, 3, pressure=3.0), ServiceAsk("b", 3, 3, pressure=2.0)]
    out = arbitrate(asks, reps("a", 1) + reps("b", 3), free=0, now=100.0)
    assert out.preemptions == () and "asked 3, granted 1" in out.grant("a").reason
    asks = [ServiceAsk("a", 0, 1, pressure=3.0), ServiceAsk("b", 3, 3, pressure=2.0)]
    out = arbitrate(asks, reps("b", 3), free=0, now=100.0)
    assert [p.donor for p in out.preemptions] == ["b"] and out.grant("a").granted == 1


def test_a_lower_class_gives_even_while_it_grows_down_to_its_min() -> None:
    asks = [ServiceAsk("vip", 1, 3, priority=9), ServiceAsk("low", 3, 5, min=2)]
    out = arbitrate(asks, reps("vip", 1) + reps("low", 3, load=2.0), free=0, now=100.0)
    assert [p.donor for p in out.preemptions] == ["low"] and out.grant("low").granted == 2
    assert out.grant("vip").granted == 2


def test_preemptions_per_round_are_bounded() -> None:
    asks = [ServiceAsk("hot", 0, 10, priority=1), ServiceAsk("cold", 10, 10)]
    out = arbitrate(asks, reps("cold", 10), free=0, now=100.0, cfg=ArbitrationConfig(max_preemptions=3))
    assert len(out.preemptions) == 3 and out.grant("hot").granted == 3 and out.grant("cold").granted == 7


def test_a_model_with_no_replica_takes_one_by_fair_share_despite_hysteresis() -> None:
    # b holds 2 (both bound a moment ago) and grows; a waits with none: fair share moves one, hysteresis or not
    asks = [ServiceAsk("a", 0, 1, pressure=1.2), ServiceAsk("b", 2, 3, pressure=5.0)]
    replicas = [Replica("b-0", "b", 3.0, 99.0), Replica("b-1", "b", 1.0, 99.5)]
    out = arbitrate(asks, replicas, free=0, now=100.0, cfg=ArbitrationConfig(hysteresis_s=30.0))
    assert [p.replica for p in out.preemptions] == ["b-1"] and "fair share" in out.preemptions[0].reason
    assert out.grant("b").granted == 1  # and b, above its min, says why it got less
    assert "asked 3, granted 1" in out.grant("b").reason


def test_no_oscillation_the_taken_replica_is_not_taken_back_next_round() -> None:
    cfg = ArbitrationConfig(hysteresis_s=30.0)
    out = arbitrate([ServiceAsk("a", 0, 1, pressure=2.0), ServiceAsk("b", 1, 1)], reps("b", 1), 0, 100.0, cfg)
    assert out.grant("a").granted == 1
    # next round the pressures flip: b wants its replica back, but a's was bound at t=100
    out2 = arbitrate([ServiceAsk("a", 1, 1), ServiceAsk("b", 0, 1, pressure=2.0)],
                     [Replica("a-0", "a", 0.0, 100.0)], 0, 110.0, cfg)
    assert out2.preemptions == () and "asked 1, granted 0" in out2.grant("b").reason


def test_result_does_not_depend_on_input_order() -> None:
    asks = [ServiceAsk("a", 1, 4, pressure=1.2), ServiceAsk("b", 3, 3, min=1), ServiceAsk("c", 2, 5, priority=1),
            ServiceAsk("d", 2, 1)]
    replicas = reps("a", 1) + reps("b", 3, load=1) + reps("c", 2) + reps("d", 2)
    first = arbitrate(asks, replicas, free=1, now=100.0)
    for perm in itertools.permutations(asks):
        assert arbitrate(list(perm), list(reversed(replicas)), free=1, now=100.0) == first


def test_floors_hold_and_total_is_conserved_on_many_inputs() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        asks, replicas = [], []
        for k in range(rng.randint(1, 5)):
            cur, mn = rng.randint(0, 5), rng.randint(0, 3)
            asks.append(ServiceAsk(f"s{k}", cur, rng.randint(0, 8), min=mn, priority=rng.randint(0, 2),
                                   pressure=rng.choice([0.0, 0.5, 1.5])))
            replicas += reps(f"s{k}", cur, load=rng.random(), bound_s=rng.choice([0.0, 95.0]))
        free = rng.randint(0, 3)
        out = arbitrate(asks, replicas, free, 100.0)
        for a in asks:
            g = out.grant(a.name)
            assert g.granted - len(g.preempted) <= a.desired
            if g.preempted:
                assert g.granted >= a.min
            assert all(r.startswith(a.name + "-") for r in g.preempted)
        total = sum(g.granted for g in out.grants) + out.free_left
        assert total == free + sum(a.current for a in asks)  # engines are neither lost nor invented


@pytest.mark.parametrize(("field", "kwargs"), [("current", {"current": -1}), ("weight", {"weight": 0.0}),
                                               ("pressure", {"pressure": float("nan")})])
def test_bad_input_names_the_field(field: str, kwargs: dict[str, float]) -> None:
    base: dict[str, object] = {"name": "x", "current": 0, "desired": 0}
    with pytest.raises(ValueError, match=field):
        ServiceAsk(**{**base, **kwargs})  # type: ignore[arg-type]


def test_unknown_service_and_duplicate_asks_are_refused() -> None:
    with pytest.raises(ValueError, match="no ask"):
        arbitrate([ServiceAsk("a", 0, 1)], [Replica("z-0", "z", 0.0, 0.0)], 0, 0.0)
    with pytest.raises(ValueError, match="asks twice"):
        arbitrate([ServiceAsk("a", 0, 1), ServiceAsk("a", 0, 1)], [], 0, 0.0)
    with pytest.raises(ValueError, match="free"):
        arbitrate([], [], -1, 0.0)
