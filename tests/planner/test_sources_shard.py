"""Sources of every kind shard: a host copy (or a host pool over several hosts) feeds a tp=g target
over g links, and local loads read over every GPU's own PCIe / SSD link in parallel."""

from __future__ import annotations

import pytest

from kascade_planner.builder import make_plan
from kascade_planner.cost import lower_bound
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

TOPO = leaf_spine(1, 6, 8, 100.0)
NODES = [n.name for n in TOPO.nodes]
MODEL = ModelLayout.uniform("m", 8, 8 * 10**9)
ONE_LINK_S = MODEL.total_bytes / (100e9 / 8)  # the whole model over one 100 Gbit/s link


@pytest.mark.parametrize("host_gpus", [1, 4])
def test_host_copy_feeds_a_tp4_target_over_four_links(host_gpus: int) -> None:
    host = Instance("host:pool", NODES[0], host_gpus, "host")
    plan = make_plan(TOPO, MODEL, [host], [Instance("t0", NODES[1], 4), Instance("t1", NODES[2], 4)], "chain")
    first_hop = [f for f in plan.flows if f.src == "host:pool"]
    assert sorted(f.shard for f in first_hop if f.shard) == [(i, 4) for i in range(4)]
    # ~1/4 of one link's time (plus the all-gather and a pipeline fill), not a whole link's.
    assert plan.completion < 0.3 * ONE_LINK_S
    assert plan.completion <= 1.05 * lower_bound(plan, TOPO)


def test_host_pool_over_several_hosts_shards_from_each() -> None:
    pool = [Instance(f"host:{n}", n, 1, "host") for n in NODES[:2]]
    targets = [Instance(f"t{i}", NODES[2 + i], 4) for i in range(4)]
    plan = make_plan(TOPO, MODEL, pool, targets, "chain")
    for h in pool:
        out = [f for f in plan.flows if f.src == h.id]
        assert sorted(f.shard for f in out if f.shard) == [(i, 4) for i in range(4)], h.id
    assert plan.completion < 0.3 * ONE_LINK_S


def test_local_loads_use_every_gpus_own_link_in_parallel() -> None:
    # Eight tp=1 targets on one node read its SSD over eight GPU links: as fast as one alone.
    eight = [Instance(f"t{i}", NODES[1], 1) for i in range(8)]
    plan = make_plan(TOPO, MODEL, [], eight, "local")
    one = make_plan(TOPO, MODEL, [], eight[:1], "local")
    ssd_s = MODEL.total_bytes / (TOPO.ssd_gbps * 1e9 / 8)
    assert one.completion == pytest.approx(ssd_s, rel=1e-3)
    assert plan.completion == pytest.approx(one.completion, rel=1e-6)


def test_tp_local_load_reads_a_shard_per_gpu() -> None:
    plan = make_plan(TOPO, MODEL, [], [Instance("t0", NODES[1], 4), Instance("t1", NODES[1], 4)], "local",
                     host_cached_nodes={NODES[1]})
    assert sorted(f.shard for f in plan.flows if f.dst == "t0" and f.shard) == [(i, 4) for i in range(4)]
    pcie_s = MODEL.total_bytes / (TOPO.pcie_gbps * 1e9 / 8)
    # A quarter over each GPU's PCIe link, then an NVLink all-gather: well under half of one link's time.
    assert max(dict(plan.predicted).values()) < 0.35 * pcie_s
