"""Tensor-parallel replicas as rank groups (planner/kascade_planner/tpgroup.py): a group is placed on one node or
refused naming `tp`; an instance plan into TP-g targets splits into g rank planes, each an ordinary validated plan
carrying exactly rank r's share of every block along the instance plan's chain; the ingest arithmetic."""

from __future__ import annotations

import itertools

import pytest

from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, PlanError
from kascade_planner.topology import Node, Topology, leaf_spine
from kascade_planner.tpgroup import (
    ingest_seconds,
    part_range,
    place_group,
    plane_mode,
    plane_plan,
    rank_id,
    rank_planes,
    whole_of,
)

MODEL = ModelLayout("m", ("embed", "layer.0", "layer.1", "head"), (1001, 4000, 4000, 999))


def _chain(g: int, src_tp: int = 1, n: int = 2):
    topo = leaf_spine(1, n + 1, 8)
    nodes = [x.name for x in topo.nodes]
    return make_plan(topo, MODEL, [Instance("s0", nodes[0], src_tp)],
                     [Instance(f"t{i}", nodes[i + 1], g) for i in range(n)], "chain", shard=False, predict=False)


def test_part_ranges_tile_the_block_exactly() -> None:
    for size in (1, 7, 1001, 4096):
        for g in (1, 2, 3, 4, 8):
            ranges = [part_range(size, r, g) for r in range(g)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert part_range(1001, 1, 2) == (501, 1001)


def test_place_group_keeps_every_rank_on_one_node_or_names_tp() -> None:
    topo = Topology((Node("a", "l", "a", 4, 100.0), Node("b", "l", "b", 8, 100.0)))
    assert place_group(topo, 4, {}) == "a"
    assert place_group(topo, 4, {"a": 1}) == "b"  # 3 free on a: the group would span nodes
    assert place_group(topo, 8, {}) == "b"
    with pytest.raises(PlanError, match="tp: 8 ranks fit on no node \\(most free GPUs on one node: 7\\)"):
        place_group(topo, 8, {"b": 1})
    with pytest.raises(PlanError, match="tp: 0"):
        place_group(topo, 0, {})


def test_parts_planes_carry_one_gth_of_every_block_along_the_same_chain() -> None:
    plan = _chain(2)
    planes = rank_planes(plan, 2, "parts")
    assert [p.rank for p in planes] == [0, 1]
    p0, p1 = planes[0].plan, planes[1].plan
    assert p0.model.block_ids == ("embed#0/2", "layer.0#0/2", "layer.1#0/2", "head#0/2")
    assert p0.model.block_bytes == (501, 2000, 2000, 500)
    assert p1.model.block_bytes == (500, 2000, 2000, 499)
    assert sum(p0.model.block_bytes) + sum(p1.model.block_bytes) == MODEL.total_bytes
    # the TP-1 source feeds every plane; the targets become their rank r, one GPU each
    assert [s.id for s in p1.sources] == ["s0"]
    assert [(t.id, t.gpus) for t in p1.targets] == [("t0.r1", 1), ("t1.r1", 1)]
    assert [(f.src, f.dst) for f in p1.flows] == [("s0", "t0.r1"), ("t0.r1", "t1.r1")]
    assert [(f.src, f.dst) for f in plan.flows] == [("s0", "t0"), ("t0", "t1")]
    assert all(whole_of(b) in MODEL.block_ids for f in p1.flows for b in f.blocks)
    assert dict(p1.fallbacks).get("t1.r1") == tuple(rank_id(x, 1) if x.startswith("t") else x
                                                     for x in dict(plan.fallbacks)["t1"])


def test_slices_planes_take_sizes_from_the_slice_manifest_and_rename_tp_sources() -> None:
    plan = _chain(2, src_tp=2)
    assert plane_mode(2, 2) == "slices" and plane_mode(1, 2) == "parts"
    with pytest.raises(PlanError, match="sizes: slices mode needs the size of 'embed@1/2'"):
        plane_plan(plan, 1, 2, "slices", {})
    sizes = {f"{b}@1/2": n for b, n in zip(MODEL.block_ids, (1001, 2100, 2100, 0), strict=True)}
    p = plane_plan(plan, 1, 2, "slices", sizes)
    assert p.model.block_ids == ("embed@1/2", "layer.0@1/2", "layer.1@1/2")  # rank 1 holds no LM head
    assert [s.id for s in p.sources] == ["s0.r1"]  # rank 1 of the source sends rank 1 its slices
    assert [(f.src, f.dst) for f in p.flows] == [("s0.r1", "t0.r1"), ("t0.r1", "t1.r1")]


def test_plane_plan_refuses_what_it_cannot_split() -> None:
    with pytest.raises(PlanError, match=r"rank: 2 outside 0\.\.1"):
        plane_plan(_chain(2), 2, 2, "parts")
    with pytest.raises(PlanError, match="targets: every target must have 4 GPUs, got \\[2\\]"):
        plane_plan(_chain(2), 0, 4, "parts")
    topo = leaf_spine(1, 3, 8)
    sharded = make_plan(topo, MODEL, [Instance("s0", topo.nodes[0].name, 2)],
                        [Instance("t0", topo.nodes[1].name, 2)], "chain", predict=False)
    with pytest.raises(PlanError, match="flows: the instance plan is already sharded"):
        plane_plan(sharded, 0, 2, "parts")


def test_ingest_arithmetic_sharded_is_g_times_faster_plus_the_gather() -> None:
    gb = 10**9
    assert ingest_seconds(gb, 2, 8.0, 1600.0, sharded=False) == pytest.approx(1.0)
    assert ingest_seconds(gb, 2, 8.0, 1600.0, sharded=True) == pytest.approx(0.5 + 4 / 1600)
    assert ingest_seconds(gb, 4, 8.0, 8.0, sharded=True) == pytest.approx(0.25 + 0.75)  # slow "NVLink": no win
    with pytest.raises(PlanError, match="must be positive"):
        ingest_seconds(gb, 2, 0.0, 1.0, sharded=True)


@pytest.mark.parametrize("algorithm", ["chain", "binomial", "hybrid"])
def test_a_sharded_plan_unshards_into_the_instance_plan_its_planes_come_from(algorithm: str) -> None:
    from kascade_planner.tpgroup import unsharded

    topo = leaf_spine(2, 3, 8)
    nodes = [x.name for x in topo.nodes]
    src = [Instance("s0", nodes[0], 2)]
    tgts = [Instance(f"t{i}", nodes[i + 1], 2) for i in range(4)]
    sharded = make_plan(topo, MODEL, src, tgts, algorithm)
    assert any(f.shard for f in sharded.flows), sharded.notes
    inst = unsharded(sharded)
    assert not any(f.shard for f in inst.flows)
    assert len(inst.flows) * 2 == len(sharded.flows)
    assert inst.predicted == sharded.predicted  # the sharded transfer's prediction stays
    for r in range(2):
        p = plane_plan(inst, r, 2, "slices", {f"{b}@{r}/2": 10 for b in MODEL.block_ids})
        assert {t.id for t in p.targets} == {f"t{i}.r{r}" for i in range(4)}
        assert len(p.steps) == (len(p.flows) if inst.steps else 0)
