"""A scale-up target on a node whose cache keeps the model's copy loads from that copy, not over the network
(issue 35 item 3): `scaleplan.build` keeps it out of every flow of the transfer plan, predicts its time as the
copy's upload on its node, and the ScalePlan spec marks it `nodeCopy` (the instruction binds it with
source.nodeCopy, the wire message both ends share)."""

from __future__ import annotations

import dataclasses

import pytest
from builders import pod

from kascade_operator import scaleplan as SP
from kascade_operator.api import ScalePlanSpec
from kascade_operator.reconcile import CreatePlan
from kascade_planner.engine_api import BindRequest, WireError

NODES = [{"metadata": {"name": n, "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                            "kascade.io/scaleup-domain": n}},
          "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for n in ("n0", "n1", "n2")]
MODEL = SP.layout("m", 8, total_bytes=8 << 30)


def _pods() -> dict[str, object]:
    keeper = dataclasses.replace(pod("k", "n1", "svc", "colocated", ready=True), host_copy="m")  # maps n1's copy
    ps = [pod("s", "n0", "svc", "colocated", ready=True), keeper, pod("t1", "n1"), pod("t2", "n2"),
          pod("f1", "n1", created_for="ns/svc"), dataclasses.replace(pod("o1", "n1"), host_copy="m")]
    return {p.pod_name: p for p in ps}


def test_a_target_on_a_copy_node_gets_no_network_flow() -> None:
    pods = _pods()
    copy_nodes = SP.node_copy_nodes(pods.values(), "m", node_cache=True)  # type: ignore[arg-type]
    assert copy_nodes == {"n1"}
    action = CreatePlan("colocated", ("s",), ("t1", "t2"), "up")
    built = SP.build(action, pods, NODES, MODEL, "chain", 1, copy_nodes=copy_nodes)  # type: ignore[arg-type]
    assert [t.id for t in built.plan.targets] == ["t2"]
    assert all(f.dst != "t1" and f.src != "t1" for f in built.plan.flows) and built.plan.flows
    assert set(built.node_copy) == {"t1"}
    net = dict(built.plan.predicted)["t2"]
    assert 0 < built.node_copy["t1"] < net  # the copy's upload on n1 (PCIe) beats a transfer over the 100G NIC
    d = SP.spec_dict(built, "svc", "colocated", "up", "/models/m")
    rows = {t["instance"]: t for t in d["targets"]}
    assert rows["t1"] == {"instance": "t1", "pod": "t1", "node": "n1", "nodeCopy": True,
                          "predictedSeconds": round(built.node_copy["t1"], 6)}
    assert "nodeCopy" not in rows["t2"] and d["predictedSeconds"] == round(max(net, built.node_copy["t1"]), 6)
    assert all(f["dst"] != "t1" for f in d["plan"]["flows"])
    assert ScalePlanSpec.model_validate(d).targets[0].node_copy is None  # the CR's model reads the field
    assert [t.node_copy for t in ScalePlanSpec.model_validate(d).targets] == [None, True]


def test_without_a_node_cache_every_target_streams() -> None:
    pods = _pods()
    assert SP.node_copy_nodes(pods.values(), "m", node_cache=False) == frozenset()  # type: ignore[arg-type]
    built = SP.build(CreatePlan("colocated", ("s",), ("t1", "t2"), "up"), pods, NODES, MODEL, "chain", 1)  # type: ignore[arg-type]
    assert {f.dst for f in built.plan.flows} == {"t1", "t2"} and not built.node_copy


def test_fallback_pods_copy_keepers_and_tp_targets_stream_or_bind_as_before() -> None:
    pods = _pods()
    nodes = frozenset({"n1"})
    # a fallback pod has no node cache; a pod keeping the copy itself binds from it (hostCopy) as before
    built = SP.build(CreatePlan("colocated", ("s",), ("f1", "o1"), "up"), pods, NODES, MODEL, "chain", 1,  # type: ignore[arg-type]
                     copy_nodes=nodes)
    assert {f.dst for f in built.plan.flows} == {"f1", "o1"} and not built.node_copy
    built = SP.build(CreatePlan("colocated", ("s",), ("t1",), "up"), pods, NODES, MODEL, "chain", 2,  # type: ignore[arg-type]
                     copy_nodes=nodes)  # a tp engine keeps no node cache (the engine refuses the flags)
    assert not built.node_copy and built.plan.targets


def test_every_target_on_copy_nodes_makes_a_local_plan() -> None:
    pods = _pods()
    built = SP.build(CreatePlan("colocated", ("s",), ("t1",), "up"), pods, NODES, MODEL, "chain", 1,  # type: ignore[arg-type]
                     copy_nodes={"n1"})
    assert built.plan.algorithm == "local" and [s.kind for s in built.plan.sources] == ["host"]
    d = SP.spec_dict(built, "svc", "colocated", "up")
    assert d["algorithm"] == "local" and [t.get("nodeCopy") for t in d["targets"]] == [True]
    assert d["predictedSeconds"] == round(built.node_copy["t1"], 6) > 0


def test_the_bind_message_carries_the_node_copy_source_both_ways() -> None:
    req = BindRequest("m", "ns/svc", source_node_copy=True)
    assert req.to_dict()["source"] == {"nodeCopy": True}
    assert BindRequest.from_dict(req.to_dict()) == req
    with pytest.raises(WireError, match=r"source\.nodeCopy"):
        BindRequest.from_dict({"model": "m", "modelService": "s", "source": {"nodeCopy": 1}})
    with pytest.raises(WireError, match="'source'"):
        BindRequest.from_dict({"model": "m", "modelService": "s", "source": {"nodeCopy": True, "hostCopy": True}})
    with pytest.raises(WireError, match="hostCopy, nodeCopy"):
        BindRequest("m", "s", source_host_copy=True, source_node_copy=True)
