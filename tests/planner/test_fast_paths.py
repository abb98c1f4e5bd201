"""The planner's fast paths agree with their plain definitions: flow constructors, run splitting,
the hybrid's cross-leaf sender choice, and the striped-plan validation shortcut."""

from __future__ import annotations

import dataclasses
import pickle
import random
from itertools import pairwise

import pytest

from kascade_planner.builder import make_plan
from kascade_planner.hybrid import _member_shape, _pick_sender, _tree
from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError, new_flow, new_flows, runs
from kascade_planner.topology import leaf_spine


def test_new_flow_and_new_flows_equal_the_dataclass() -> None:
    blocks = ("a", "b")
    assert new_flow("s", "t", blocks) == Flow("s", "t", blocks)
    assert new_flow("s", "t", blocks, (1, 4)) == Flow("s", "t", blocks, (1, 4))
    many = new_flows(["s", "t0", "t1"], ["t0", "t1", "t2"], blocks)
    assert many == [Flow("s", "t0", blocks), Flow("t0", "t1", blocks), Flow("t1", "t2", blocks)]
    assert all(f.blocks is blocks for f in many)  # shared: validation keys block sets by identity
    f = many[0]
    assert hash(f) == hash(Flow("s", "t0", blocks)) and pickle.loads(pickle.dumps(f)) == f
    assert dataclasses.replace(f, dst="x") == Flow("s", "x", blocks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.src = "other"  # type: ignore[misc]
    with pytest.raises(ValueError):
        new_flows(["a", "b"], ["c"], blocks)


def test_runs_split_keys_into_maximal_runs() -> None:
    rng = random.Random(3)
    for _ in range(50):
        keys = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 30))]
        parts = list(runs(keys))
        assert [k for k, s, e in parts for _ in range(s, e)] == keys
        assert all(keys[s:e] == [k] * (e - s) and e > s for k, s, e in parts)
        assert all(a[0] != b[0] for a, b in pairwise(parts))  # maximal


def test_pick_sender_is_the_minimum_of_the_ranking() -> None:
    """The first position in preference order of the best class is min over (slots full, cross-leaf
    budget spent, depth, position), as the builder defines the choice."""
    rng = random.Random(7)
    for _ in range(300):
        f, n = rng.randint(1, 4), rng.randint(1, 40)
        j = rng.randrange(f)
        shape = _member_shape(n, f)
        edges = _tree(n, j if n >= f else j % n, f)
        depth = {-1: 0}
        for a, b in edges:
            depth[b] = depth[a] + 1
        ids = [f"m{q}" for q in range(n)]
        count = [min(f + 1, u + rng.randint(0, 2)) for u in shape.used]
        cap = rng.randint(1, 2)
        cross = {i: rng.randint(0, 3) for i in ids if rng.random() < 0.5}
        want = min(range(n), key=lambda q: (count[q] >= f, cross.get(ids[q], 0) >= cap, depth.get(q, n), q))
        assert _pick_sender(shape.prefer[j], count, ids, cross, f, cap) == want


def test_striped_plan_fed_twice_is_rejected() -> None:
    """A stripe's second feed of one target, listed in another run of that stripe's flows, is not
    accepted by the fast stripes check; the detailed checks name it."""
    topo = leaf_spine(4, 9, 8)
    src = [Instance("s0", "node-0-0")]
    tgt = [Instance(f"t{i}", f"node-{i % 4}-{1 + i // 4}") for i in range(24)]
    model = ModelLayout.uniform("m", 8, 10**9)
    plan = make_plan(topo, model, src, tgt, "hybrid", stripes=2, predict=False)
    first = plan.flows[0]
    assert first.blocks is not plan.flows[-1].blocks  # the duplicate starts a new run
    twice = Plan(plan.algorithm, plan.model, plan.sources, plan.targets, (*plan.flows, first))
    with pytest.raises(PlanError, match="twice"):
        twice.validate()
    plan.validate()
