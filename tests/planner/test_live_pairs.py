"""Live pairs: one to one, overloaded sources first, each with the first target of its own chain."""

from __future__ import annotations

import pytest

from kascade_planner.builder import make_plan, pair_live
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

TOPO = leaf_spine(2, 4, 8, 100.0)
NODES = [n.name for n in TOPO.nodes]
MODEL = ModelLayout.uniform("m", 8, 8 * 10**9)


def inst(prefix: str, idx: list[int]) -> list[Instance]:
    return [Instance(f"{prefix}{k}", NODES[i], 1) for k, i in enumerate(idx)]


@pytest.mark.parametrize("algorithm", ["chain", "binomial", "star", "tree"])
def test_each_serving_source_pairs_with_one_distinct_target(algorithm: str) -> None:
    srcs, tgts = inst("s", [0, 4]), inst("t", [1, 2, 3, 5, 6, 7])
    plan = make_plan(TOPO, MODEL, srcs, tgts, algorithm, live=True)
    assert sorted(s for s, _ in plan.live_pairs) == ["s0", "s1"]
    loading = [t for _, t in plan.live_pairs]
    assert len(set(loading)) == 2 and set(loading) <= {t.id for t in tgts}
    assert make_plan(TOPO, MODEL, srcs, tgts, algorithm, live=False).live_pairs == ()  # live off: none


def test_chain_heads_pair_with_their_chain_first_target() -> None:
    plan = make_plan(TOPO, MODEL, inst("s", [0, 4]), inst("t", [1, 2, 5, 6]), "chain", live=True)
    first = {c[0]: c[1] for c in plan.chains}
    assert len(first) == 2 and dict(plan.live_pairs) == first
    more = make_plan(TOPO, MODEL, inst("s", [0]), inst("t", [1, 2, 5]), "chain", live=True)
    assert len(more.live_pairs) == 1  # one source, one pair: the source is not swamped by every target


def test_first_copy_has_no_live_pairs_and_overloaded_go_first() -> None:
    local = make_plan(TOPO, MODEL, [], inst("t", [1, 2]), "local", live=True)
    assert local.live_pairs == ()
    star = make_plan(TOPO, MODEL, inst("s", [0, 4]), inst("t", [1]), "star", live=False)
    assert pair_live(star, overloaded=["s1"]) in ((("s0", "t0"),), (("s1", "t0"),))
    no_chain = star.__class__(**{**star.__dict__, "chains": ()})
    assert pair_live(no_chain, overloaded=["s1"]) == (("s1", "t0"),)  # the overloaded one gets the only target
