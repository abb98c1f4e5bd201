"""Every plan kind the planner emits runs through real transfer processes (TCP on loopback): each
target ends with byte-identical blocks. Chains (and star/tree, whole-model flows too) are covered by
test_transfer_processes; here the λScale binomial (flows of partial block lists in step order),
hybrid striped trees (stripes fanned in from several senders, across two leaves), a host-memory
source sharding its hop to tp=2 targets, and binomial / hybrid plans over two shard planes for tp=2
targets (every relay forwards the shard it holds; each target receives every block's two shards)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from kascade_engine.weights.blocks import BlockSet
from kascade_engine.weights.hostcache import open_cache
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["binomial", "hybrid", "host-sharded", "binomial-tp2", "hybrid-tp2"])
def test_plan_kind_delivers_identical_blocks(tmp_path: Path, harness: ModuleType, tiny_blocks: BlockSet,
                                             kind: str) -> None:
    topo = leaf_spine(2, 4, 8, inter_leaf_ratio=0.5)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("tiny", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
    if kind == "host-sharded":
        src, gpus, alg = [Instance("s0", nodes[0], 1, "host")], 2, "chain"
    elif kind == "binomial-tp2":
        src, gpus, alg = [Instance("s0", nodes[0], 2)], 2, "binomial"
    elif kind == "hybrid-tp2":
        src, gpus, alg = [Instance("s0", nodes[0], 1, "host")], 2, "hybrid"
    else:
        src, gpus, alg = [Instance("s0", nodes[0])], 1, kind
    targets = [Instance(f"t{i}", nodes[i + 1], gpus) for i in (0, 3, 4)]  # leaf 0: t0; leaf 1: t1, t2
    plan = make_plan(topo, model, src, targets, alg)
    assert plan.algorithm == alg
    if kind == "hybrid":
        assert max(sum(1 for f in plan.flows if f.dst == t.id) for t in targets) == 2  # two stripes each
    if kind.endswith("-tp2"):  # two shard planes; relays forward shards between targets
        assert {f.shard for f in plan.flows} == {(0, 2), (1, 2)}
        assert any(f.src != "s0" for f in plan.flows)
    if kind == "host-sharded":
        assert {f.shard for f in plan.flows if f.src == "s0"} == {(0, 2), (1, 2)}
    c = harness.make_cluster(tmp_path, tiny_blocks, plan)
    c.start_all()
    try:
        for t in plan.targets:
            summary = c.wait(t.id)
            assert summary["resident"] == len(tiny_blocks.ids) and summary["refetches"] == 0, summary
            got = open_cache(tmp_path / f"{t.id}.kcache", verify=True)
            assert all(bytes(got.blocks[b].data) == bytes(tiny_blocks.blocks[b].data) for b in tiny_blocks.ids)
    finally:
        c.stop()
