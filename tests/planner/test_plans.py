"""Plans: table-driven expectations and hypothesis properties for every algorithm."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scenarios import Scenario

from kascade_planner.builder import make_plan
from kascade_planner.cost import CostParams, _predict_events, _predict_pipelined, lower_bound, predict
from kascade_planner.plan import Flow, Instance, Plan, PlanError

ALGS = ["chain", "binomial", "hybrid", "auto", "star", "tree", "local"]


def received(plan: Plan) -> dict[tuple[str, str], Counter[int]]:
    got: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)
    for f in plan.flows:
        for b in f.blocks:
            got[(f.dst, b)][f.shard[0] if f.shard else 0] += 1
    return got


def check_invariants(plan: Plan) -> None:
    # Every target holds every block exactly once (or each of its shards exactly once).
    got = received(plan)
    for t in plan.targets:
        for b in plan.model.block_ids:
            shards = got[(t.id, b)]
            assert shards and set(shards.values()) == {1}, (t.id, b, shards)
            counts = {f.shard[1] if f.shard else 1 for f in plan.inbound(t.id) if b in f.blocks}
            assert len(counts) == 1 and len(shards) == counts.pop()


def test_chain_follows_leaves_and_is_near_lower_bound(scenario: Scenario) -> None:
    # One source per leaf, three targets per leaf: two chains that never cross leaves.
    src = scenario.instances("s", [0, 4])
    tgt = scenario.instances("t", [1, 2, 3, 5, 6, 7])
    plan = make_plan(scenario.topo, scenario.model, src, tgt, "chain")
    leaf = {n.name: n.leaf for n in scenario.topo.nodes}
    assert len(plan.chains) == 2
    for chain in plan.chains:
        assert len({leaf[plan.instance(i).node] for i in chain}) == 1, chain
    assert plan.completion <= 1.05 * lower_bound(plan, scenario.topo)
    check_invariants(plan)


def test_chain_borrows_a_source_for_a_leaf_without_one() -> None:
    sc = Scenario(leaves=2, nodes_per_leaf=4, ratio=0.5)
    plan = make_plan(sc.topo, sc.model, sc.instances("s", [0, 1]), sc.instances("t", [4, 5, 6]), "chain")
    assert any("borrowing" in n for n in plan.notes)
    check_invariants(plan)


def test_chain_prunes_sources_whose_egress_carries_kv(scenario: Scenario) -> None:
    prefill = scenario.instances("p", [0, 1])
    decode = scenario.instances("d", [2, 3])
    kv = [("p0", "d0"), ("p1", "d1")]  # prefill -> decode KV flows
    plan = make_plan(scenario.topo, scenario.model, [*prefill, *decode], scenario.instances("t", [4, 5]), "chain",
                     kv_flows=kv)
    senders = {f.src for f in plan.flows}
    assert not senders & {"p0", "p1"}
    assert any("pruned source p0" in n for n in plan.notes)
    with pytest.raises(PlanError, match="every source's egress carries a KV flow"):
        make_plan(scenario.topo, scenario.model, prefill, scenario.instances("t", [4]), "chain", kv_flows=kv)


def test_sharded_transfer_between_equal_tp_instances(scenario: Scenario) -> None:
    src = scenario.instances("s", [0], gpus=8)
    tgt = scenario.instances("t", [1, 2], gpus=8)
    sharded = make_plan(scenario.topo, scenario.model, src, tgt, "chain")
    whole = make_plan(scenario.topo, scenario.model, src, tgt, "chain", shard=False)
    assert {f.shard for f in sharded.flows} == {(i, 8) for i in range(8)}
    check_invariants(sharded)
    assert whole.completion / sharded.completion > 6  # ~8x: every GPU link carries 1/8


def test_star_is_about_n_times_chain(scenario: Scenario) -> None:
    src = scenario.instances("s", [0])
    tgt = scenario.instances("t", list(range(1, 8)))
    star = make_plan(scenario.topo, scenario.model, src, tgt, "star")
    chain = make_plan(scenario.topo, scenario.model, src, tgt, "chain")
    assert 6.0 < star.completion / chain.completion < 7.5


def test_local_load_uses_host_cache_or_ssd(scenario: Scenario) -> None:
    tgt = scenario.instances("t", [1, 2])
    plan = make_plan(scenario.topo, scenario.model, [], tgt, "local", host_cached_nodes={scenario.nodes[1]})
    kinds = {s.id: s.kind for s in plan.sources}
    assert kinds == {f"host:{scenario.nodes[1]}": "host", f"ssd:{scenario.nodes[2]}": "ssd"}
    by_target = dict(plan.predicted)
    assert by_target["t1"] / by_target["t0"] == pytest.approx(128 / 10, rel=0.01)


def test_plan_json_round_trip_and_bad_documents(scenario: Scenario) -> None:
    plan = make_plan(
        scenario.topo,
        scenario.model,
        scenario.instances("s", [0]),
        scenario.instances("t", [1, 2]),
        "chain",
        overloaded=["s0"],
    )
    doc = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(doc) == plan
    assert plan.live_pairs == (("s0", "t0"),) or plan.live_pairs == (("s0", "t1"),)
    with pytest.raises(PlanError, match="missing field 'flows'"):
        Plan.from_dict({k: v for k, v in doc.items() if k != "flows"})
    with pytest.raises(PlanError, match="unknown algorithm 'teleport'"):
        Plan.from_dict({**doc, "algorithm": "teleport"})
    broken = {**doc, "flows": doc["flows"][:-1]}
    with pytest.raises(PlanError, match="never receives all of block"):
        Plan.from_dict(broken)


def test_forwarding_a_block_never_received_is_rejected(scenario: Scenario) -> None:
    src, (a, b) = scenario.instances("s", [0]), scenario.instances("t", [1, 2])
    model = scenario.model
    bad = Plan(
        "chain", model, tuple(src), (a, b), (Flow("s0", "t0", model.block_ids[:-1]), Flow("t0", "t1", model.block_ids))
    )
    with pytest.raises(PlanError):
        bad.validate()
    with pytest.raises(PlanError, match="'t0' must forward block 'head' it never receives"):
        predict(
            Plan(
                "chain",
                model,
                tuple(src),
                (a, b),
                (
                    Flow("s0", "t0", model.block_ids[:-1]),
                    Flow("s0", "t0", ("head",)),
                    Flow("t0", "t1", model.block_ids),
                )[::2],
            ),
            scenario.topo,
        )


def test_forwarding_cycles_are_rejected(scenario: Scenario) -> None:
    model = scenario.model
    src, (a, b) = tuple(scenario.instances("s", [0])), tuple(scenario.instances("t", [1, 2]))
    # Each target receives the model exactly once, but only from the other: nobody ever holds it.
    cycle = Plan("chain", model, src, (a, b), (Flow("t0", "t1", model.block_ids), Flow("t1", "t0", model.block_ids)))
    with pytest.raises(PlanError, match="forwards block 'embed' it never holds"):
        cycle.validate()
    with pytest.raises(PlanError, match="it never holds"):
        Plan.from_dict(json.loads(json.dumps(cycle.to_dict())))
    # Per block: t0 gets 'embed' from the source, but the rest only via t1, which gets it from t0.
    rest = model.block_ids[1:]
    per_block = Plan(
        "binomial",
        model,
        src,
        (a, b),
        (Flow("s0", "t0", model.block_ids[:1]), Flow("t0", "t1", model.block_ids), Flow("t1", "t0", rest)),
    )
    with pytest.raises(PlanError, match=f"'t0' forwards block {rest[0]!r} it never holds"):
        per_block.validate()


def test_forwarding_after_all_gather_and_crossed_shards_are_accepted(scenario: Scenario) -> None:
    model = scenario.model
    src = tuple(scenario.instances("s", [0], gpus=2))
    a, b = scenario.instances("t", [1, 2], gpus=2)
    whole = model.block_ids
    # a receives both shards, all-gathers, then forwards whole blocks to b.
    gathered = Plan("chain", model, src, (a, b), (Flow("s0", "t0", whole, (0, 2)), Flow("s0", "t0", whole, (1, 2)),
                                                  Flow("t0", "t1", whole)))
    assert gathered.validate() is gathered
    # Crossed shards: each target gets one shard from the source and the other from its peer.
    crossed = Plan("chain", model, src, (a, b), (Flow("s0", "t0", whole, (0, 2)), Flow("s0", "t1", whole, (1, 2)),
                                                 Flow("t0", "t1", whole, (0, 2)), Flow("t1", "t0", whole, (1, 2))))
    assert crossed.validate() is crossed
    assert predict(crossed, scenario.topo).makespan > 0


@st.composite
def problems(draw: st.DrawFn) -> tuple[Scenario, list[Instance], list[Instance], str, int]:
    leaves = draw(st.integers(1, 3))
    per = draw(st.integers(2, 5))
    sc = Scenario(leaves=leaves, nodes_per_leaf=per, gpus=8, ratio=draw(st.sampled_from([1.0, 0.5])))
    n = leaves * per
    idx = draw(st.permutations(list(range(n))))
    k = draw(st.integers(1, max(1, n // 2)))
    m = draw(st.integers(1, n - k))
    gpus = draw(st.sampled_from([1, 2]))
    return sc, sc.instances("s", idx[:k], gpus), sc.instances("t", idx[k:k + m], gpus), draw(st.sampled_from(ALGS)), k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_properties_hold_for_every_algorithm(
    problem: tuple[Scenario, list[Instance], list[Instance], str, int],
) -> None:
    sc, src, tgt, alg, _ = problem
    plan = make_plan(sc.topo, sc.model, src, tgt, alg)
    check_invariants(plan)
    # Deterministic for equal inputs (also when inputs arrive in another order).
    assert make_plan(sc.topo, sc.model, src[::-1], tgt[::-1], alg) == plan
    # No target forwards a block before holding it: every hop out of a target starts after it
    # received that block's first chunk, which the cost model enforces; check arrival ordering.
    arrival = {t: dict(per) for t, per in predict(plan, sc.topo).arrival}
    for f in plan.flows:
        if f.src in arrival:
            for b in f.blocks:
                assert arrival[f.dst][b] >= arrival[f.src][b] - 1e-9
    assert plan.completion >= lower_bound(plan, sc.topo) * (1 - 1e-9)
    check_link_promise(plan)


def check_link_promise(plan: Plan) -> None:
    """What each plan kind promises about link sharing (the cost model's assumptions).
    chain: one flow per GPU link per direction. binomial: per step, a node sends at most one block and
    receives at most one. hybrid with f stripes: every target receives each stripe once (f flows in)
    and forwards at most f flows, one stripe's (f+1 on a few relays when the group size is not 0 or 1
    mod f: the cost model charges that share)."""
    if plan.algorithm == "chain":
        out = Counter((f.src, f.shard[0] if f.shard else 0) for f in plan.flows)
        inn = Counter((f.dst, f.shard[0] if f.shard else 0) for f in plan.flows)
        assert max(out.values()) == 1 and max(inn.values()) == 1
    elif plan.algorithm == "binomial":  # per GPU link (shard plane) when sharded
        assert len(plan.steps) == len(plan.flows)
        pairs = list(zip(plan.flows, plan.steps, strict=True))
        sends = Counter((f.src, slot(f), st) for f, steps in pairs for st in steps)
        recvs = Counter((f.dst, slot(f), st) for f, steps in pairs for st in steps)
        assert max(sends.values()) == 1 and max(recvs.values()) == 1
        # No forwarding before holding: a relay sends a block only at a later step than it got it.
        got = {(f.dst, b, slot(f)): st for f, steps in pairs for b, st in zip(f.blocks, steps, strict=True)}
        for f, steps in pairs:
            for b, st in zip(f.blocks, steps, strict=True):
                assert f.src not in {t.id for t in plan.targets} or got[(f.src, b, slot(f))] < st
    elif plan.algorithm == "hybrid":
        f_count = len({f.blocks for f in plan.flows})
        inn = Counter((f.dst, slot(f)) for f in plan.flows)
        assert set(inn.values()) == {f_count}  # each stripe once (per shard plane)
        out = Counter((f.src, slot(f)) for f in plan.flows if f.src in {t.id for t in plan.targets})
        assert max(out.values(), default=0) <= f_count + 1  # f slots (f+1 on a few relays: n mod f not 0, 1)
        node = {i.id: i.node for i in (*plan.sources, *plan.targets)}
        leaf = {n: n.split("-")[1] for n in node.values()}  # leaf_spine names nodes node-<leaf>-<i>
        cross = [f for f in plan.flows if leaf[node[f.src]] != leaf[node[f.dst]] and f.src not in
                 {s.id for s in plan.sources}]
        cap = max(1, int(0.5 * f_count)) if len(set(leaf.values())) > 1 else f_count
        assert max(Counter((f.src, slot(f)) for f in cross).values(), default=0) <= max(cap, f_count)
    if plan.algorithm in ("binomial", "hybrid") and all(t.gpus == 2 for t in plan.targets) \
            and all(s.gpus == 2 for s in plan.sources):
        assert {f.shard for f in plan.flows} == {(0, 2), (1, 2)}  # tp=2: both GPU links of every hop


def slot(f: Flow) -> int:
    return f.shard[0] if f.shard else 0


@settings(max_examples=40, deadline=None)
@given(problems())
def test_chain_plans_are_interference_free(problem: tuple[Scenario, list[Instance], list[Instance], str, int]) -> None:
    sc, src, tgt, _, _ = problem
    # Serving traffic: prefill s0 sends KV to decode s1 (s0's egress and s1's ingress are busy).
    kv = [(src[0].id, src[1].id)] if len(src) > 1 else []
    plan = make_plan(sc.topo, sc.model, src, tgt, "chain", kv_flows=kv)
    out: Counter[tuple[str, int]] = Counter((a, 0) for a, _ in kv)
    inn: Counter[tuple[str, int]] = Counter((b, 0) for _, b in kv)
    for f in plan.flows:
        slot = f.shard[0] if f.shard else 0
        out[(f.src, slot)] += 1
        inn[(f.dst, slot)] += 1
    # One flow per GPU link per direction, KV flows included.
    assert max(out.values()) == 1, out
    assert max(inn.values()) == 1, inn


@settings(max_examples=30, deadline=None)
@given(problems())
def test_closed_form_cost_matches_the_event_simulation(
    problem: tuple[Scenario, list[Instance], list[Instance], str, int],
) -> None:
    sc, src, tgt, _, _ = problem
    for alg in ("chain", "local"):
        plan = make_plan(sc.topo, sc.model, src, tgt, alg, predict=False, host_cached_nodes={src[0].node})
        fast = _predict_pipelined(plan, sc.topo, CostParams())
        assert fast is not None, alg  # interference-free whole-model plans take the closed form
        slow = _predict_events(plan, sc.topo)
        for (t1, per1), (t2, per2) in zip(fast.arrival, slow.arrival, strict=True):
            assert t1 == t2
            assert [b for b, _ in per1] == [b for b, _ in per2]
            assert [x for _, x in per1] == pytest.approx([y for _, y in per2], rel=1e-9)
    # Shared links (a star's source feeds every target) go through the event simulation.
    assert (
        _predict_pipelined(
            make_plan(sc.topo, sc.model, src, [*tgt, Instance("extra", tgt[0].node)], "star", predict=False),
            sc.topo,
            CostParams(),
        )
        is None
    )
