"""Chains rank sources by the rate they can send at: a host-memory copy at min(NIC, PCIe) (what the cost model's
`pair_gbps` charges it), a GPU at its NIC. With RDMA faster than PCIe a GPU source beats the host pool, whatever
their ids; with PCIe faster than the NICs they tie and the GPU still goes first (the pool's memory is shared by
every load of the model). Issue 39: every load ran at PCIe speed (2.27 s for 72B instead of 0.73 s)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kascade_planner.builder import make_plan
from kascade_planner.cost import pair_gbps, predict
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

MODEL = ModelLayout.uniform("m", 8, 8 * 10**9)


def plan_for(rdma_gbps: float, pcie_gbps: float, gpu_id: str = "i9") -> tuple[float, tuple[str, ...]]:
    topo = replace(leaf_spine(1, 3, 8, rdma_gbps), pcie_gbps=pcie_gbps)
    nodes = [n.name for n in topo.nodes]
    # ids sort the pool first ("host:..." < "i..."): the old tie-break by id
    pool = Instance("host:pool:0", nodes[0], 4, "host")
    gpu = Instance(gpu_id, nodes[1], 4)
    target = Instance("t0", nodes[2], 4)
    plan = make_plan(topo, MODEL, [pool, gpu], [target], "chain", predict=False)
    return predict(plan, topo).makespan, plan.chains[0]


def test_rdma_above_pcie_loads_from_the_gpu() -> None:
    t, chain = plan_for(400.0, 128.0)
    assert chain == ("i9", "t0"), chain
    # 8 GB over 4 x 400 Gbit/s: ~0.04 s, not the ~0.125 s the PCIe-capped pool takes
    assert t < 0.5 * MODEL.total_bytes / (4 * 128e9 / 8), t
    slow, pool_chain = plan_for(400.0, 128.0, gpu_id="a9")  # id order no longer matters either way
    assert pool_chain == ("a9", "t0") and slow == pytest.approx(t)


def test_a_host_copy_ranks_at_its_pcie_cap_as_the_cost_model_charges() -> None:
    topo = replace(leaf_spine(1, 2, 8, 400.0), pcie_gbps=128.0)
    a, b = (n.name for n in topo.nodes)
    assert pair_gbps(topo, Instance("h", a, 4, "host"), Instance("t", b, 4)) == 128.0


def test_a_tie_goes_to_the_gpu_and_a_faster_pool_still_wins() -> None:
    _, chain = plan_for(100.0, 128.0)  # the pool is capped by its NIC: a tie
    assert chain == ("i9", "t0"), chain
    topo = replace(leaf_spine(1, 3, 8, 100.0), pcie_gbps=128.0)
    nodes = [n.name for n in topo.nodes]
    slow_nic = replace(topo, nodes=(topo.nodes[0], replace(topo.nodes[1], nic_gbps=25.0), topo.nodes[2]))
    plan = make_plan(slow_nic, MODEL, [Instance("host:pool:0", nodes[0], 4, "host"), Instance("i9", nodes[1], 4)],
                     [Instance("t0", nodes[2], 4)], "chain", predict=False)
    assert plan.chains[0] == ("host:pool:0", "t0")  # the GPU's NIC is slower than the pool's min(NIC, PCIe)
