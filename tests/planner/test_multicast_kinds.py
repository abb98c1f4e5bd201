"""Binomial pipeline to its bound, hybrid striped trees, the spine-aware lower bound and mode auto."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kascade_planner.auto import chain_floor, estimate_hybrid
from kascade_planner.builder import make_plan
from kascade_planner.cost import CostParams, lower_bound, spine_bound
from kascade_planner.plan import Flow, Instance, ModelLayout, Plan, PlanError
from kascade_planner.topology import Topology, leaf_spine

MODEL = ModelLayout.uniform("m", 32, 16 * 10**9)


def spread(topo: Topology, n_src: int, n_tgt: int) -> tuple[list[Instance], list[Instance]]:
    """Sources on the first node of the first leaves, targets round robin over leaves on the rest."""
    leaves: dict[str, list[str]] = {}
    for n in topo.nodes:
        leaves.setdefault(n.leaf, []).append(n.name)
    src = [Instance(f"s{i}", names[0]) for i, names in enumerate(list(leaves.values())[:n_src])]
    free = [n for group in zip(*[names[1:] for names in leaves.values()], strict=False) for n in group]
    return src, [Instance(f"t{i}", free[i]) for i in range(n_tgt)]


def test_binomial_meets_its_step_bound() -> None:
    topo = leaf_spine(1, 9, 8)
    src, tgt = spread(topo, 1, 8)
    plan = make_plan(topo, MODEL, src, tgt, "binomial")
    b, steps = len(MODEL.block_ids), max(s for st in plan.steps for s in st) + 1
    assert steps <= b + 4  # b + ceil(log2 9) - 1 on a hypercube with one spare node
    block_s = MODEL.block_bytes[0] / (100e9 / 8)
    assert plan.completion <= steps * block_s * 1.01
    assert plan.completion <= 1.10 * lower_bound(plan, topo)
    doc = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(doc) == plan  # steps travel with the plan


def test_binomial_k_is_chosen_by_the_cost_model() -> None:
    topo = leaf_spine(4, 9, 8)
    src, tgt = spread(topo, 4, 16)
    plan = make_plan(topo, MODEL, src, tgt, "binomial")
    assert any("chosen by the cost model" in n for n in plan.notes)
    assert plan.completion <= 1.10 * lower_bound(plan, topo)


def test_steps_that_forward_before_holding_are_rejected() -> None:
    model = ModelLayout("m", ("a", "b"), (10, 10))
    s, t0, t1 = Instance("s", "node-0-0"), Instance("t0", "node-0-1"), Instance("t1", "node-0-2")
    flows = (Flow("s", "t0", ("a", "b")), Flow("t0", "t1", ("a", "b")))
    Plan("binomial", model, (s,), (t0, t1), flows, steps=((0, 1), (1, 2))).validate()
    with pytest.raises(PlanError, match="sends block 'b' at step 1, before it holds it"):
        Plan("binomial", model, (s,), (t0, t1), flows, steps=((0, 1), (1, 1))).validate()
    with pytest.raises(PlanError, match="one step >= 0 per block"):
        Plan("binomial", model, (s,), (t0, t1), flows, steps=((0,), (1, 2))).validate()


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_hybrid_stays_near_the_bound_where_chains_fill_slowly(ratio: float) -> None:
    topo = leaf_spine(16, 33, 8, inter_leaf_ratio=ratio)
    src, tgt = spread(topo, 2, 512)
    hybrid = make_plan(topo, MODEL, src, tgt, "hybrid")
    chain = make_plan(topo, MODEL, src, tgt, "chain")
    lb = lower_bound(hybrid, topo)
    assert hybrid.completion <= 1.05 * lb
    assert chain.completion > 1.2 * lb  # 256-target chains: a long pipeline fill (and slow spine hops)
    # The closed form auto uses at scale is the cost model's own number for this plan.
    assert estimate_hybrid(hybrid, topo, CostParams()) == pytest.approx(hybrid.completion, rel=0.01)
    # Spine-aware striping: no GPU link carries more cross-leaf flows than its uplink share allows.
    leaf = {i.id: topo.node(i.node).leaf for i in (*hybrid.sources, *hybrid.targets)}
    cross = [f for f in hybrid.flows if leaf[f.src] != leaf[f.dst]]
    cap = max(1, int(ratio * 2))
    assert max(Counter(f.src for f in cross).values()) <= cap and max(Counter(f.dst for f in cross).values()) <= cap
    assert chain_floor(topo, MODEL, src, tgt, CostParams()) <= chain.completion


def test_spine_aware_bound_charges_a_sourceless_leaf_its_uplink() -> None:
    topo = leaf_spine(2, 4, 8, inter_leaf_ratio=0.5)
    src, lone = [Instance("s0", "node-0-0")], [Instance("t0", "node-1-0")]
    plan = make_plan(topo, MODEL, src, lone, "chain")
    link_s = MODEL.total_bytes / (100e9 / 8)
    assert spine_bound(plan, topo) == pytest.approx(2 * link_s)  # one GPU link at half rate
    assert lower_bound(plan, topo) >= 2 * link_s
    assert plan.completion == pytest.approx(lower_bound(plan, topo), rel=0.02)
    four = [Instance(f"t{i}", f"node-1-{i}") for i in range(4)]
    assert spine_bound(make_plan(topo, MODEL, src, four, "chain"), topo) == pytest.approx(link_s / 2)


def test_auto_picks_the_fastest_candidate_and_says_why() -> None:
    topo = leaf_spine(8, 17, 8)
    src, tgt = spread(topo, 2, 128)
    auto = make_plan(topo, MODEL, src, tgt, "auto")
    others = {a: make_plan(topo, MODEL, src, tgt, a).completion for a in ("chain", "hybrid")}
    assert auto.completion <= min(others.values()) * (1 + 1e-9)
    assert auto.notes[-1].startswith(f"auto: {auto.algorithm}") and "others:" in auto.notes[-1]
    # tp>1 targets: chains shard a hop over every GPU link; auto keeps them.
    wide = [Instance(t.id, t.node, 4) for t in tgt[:8]]
    assert make_plan(topo, MODEL, [Instance("s0", src[0].node, 4)], wide, "auto").algorithm == "chain"
    with pytest.raises(PlanError, match="choose one of auto, chain"):
        make_plan(topo, MODEL, src, tgt, "teleport")
