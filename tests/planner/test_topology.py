"""Topology parsing from Kubernetes Node objects and topology files; bandwidth rules."""

from __future__ import annotations

from typing import Any

import pytest

from kascade_planner.topology import (
    LabelKeys,
    TopologyError,
    leaf_spine,
    topology_from_dict,
    topology_from_nodes,
)


def k8s_node(name: str, gpus: object = "8", **labels: str) -> dict[str, Any]:
    base = {"kascade.io/leaf": "leaf-a", "kascade.io/scaleup-domain": name, "kascade.io/nic-gbps": "100"}
    return {
        "metadata": {"name": name, "labels": {**base, **labels}},
        "status": {"allocatable": {"nvidia.com/gpu": gpus}},
    }


def test_nodes_parse_with_labels_and_gpu_capacity() -> None:
    topo = topology_from_nodes([k8s_node("b", **{"kascade.io/leaf": "leaf-b"}), k8s_node("a"),
                                {"metadata": {"name": "cpu-only"}, "status": {"allocatable": {"cpu": "4"}}}],
                               inter_leaf_ratio=0.5)
    assert [n.name for n in topo.nodes] == ["a", "b"]  # sorted; GPU-less nodes skipped
    assert topo.node("a").gpus == 8 and topo.node("a").nic_gbps == 100.0
    assert topo.bandwidth_gbps("a", "b") == 50.0  # across leaves
    assert topo.total_gpus == 16


def test_custom_label_keys() -> None:
    keys = LabelKeys(leaf="topo/leaf", domain="topo/nvl", nic_gbps="topo/nic")
    node = {"metadata": {"name": "x", "labels": {"topo/leaf": "l", "topo/nvl": "d", "topo/nic": "400"}},
            "status": {"capacity": {"nvidia.com/gpu": "4"}}}
    assert topology_from_nodes([node], keys).node("x").nic_gbps == 400.0


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (k8s_node("n1", **{"kascade.io/leaf": ""}), "node 'n1': missing label 'kascade.io/leaf'"),
        (k8s_node("n2", **{"kascade.io/nic-gbps": "fast"}), "node 'n2': label 'kascade.io/nic-gbps' must be a number"),
        (
            k8s_node("n3", **{"kascade.io/nic-gbps": "-5"}),
            "node 'n3': label 'kascade.io/nic-gbps' must be a finite number >= ",
        ),
        (k8s_node("n4", gpus="many"), "node 'n4': nvidia.com/gpu must be a number"),
    ],
)
def test_bad_labels_name_node_and_label(node: dict[str, Any], message: str) -> None:
    with pytest.raises(TopologyError) as e:
        topology_from_nodes([node])
    assert message in str(e.value)


def test_bandwidth_rules() -> None:
    topo = topology_from_dict({"interLeafBandwidthRatio": 0.25, "nvlinkGbps": 900, "nodes": [
        {"name": "a", "leaf": "l0", "domain": "nvl", "gpus": 4, "nicGbps": 200},
        {"name": "b", "leaf": "l0", "domain": "nvl", "gpus": 4, "nicGbps": 200},
        {"name": "c", "leaf": "l0", "gpus": 8, "nicGbps": 100},
        {"name": "d", "leaf": "l1", "gpus": 8, "nicGbps": 400}]})
    assert topo.bandwidth_gbps("a", "b") == 900  # one NVLink domain spanning two nodes
    assert topo.bandwidth_gbps("a", "c") == 100  # min of the two NICs inside a leaf
    assert topo.bandwidth_gbps("a", "d") == 50  # 200 * 0.25 across leaves


@pytest.mark.parametrize(
    ("doc", "message"),
    [({}, "no nodes"), ({"nodes": [{"name": "x", "leaf": "l"}]}, "node 'x': missing field 'gpus'"),
     ({"nodes": [{"leaf": "l"}]}, "nodes[0]: needs a name"),
     ({"interLeafBandwidthRatio": 2, "generate": {"leaves": 1}}, "interLeafBandwidthRatio must be a number in (0, 1]"),
     ({"nodes": [{"name": "x", "leaf": "l", "gpus": 1, "nicGbps": 1}] * 2}, "node 'x' appears twice")],
)
def test_bad_topology_documents(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(TopologyError) as e:
        topology_from_dict(doc)
    assert message in str(e.value)


def test_leaf_spine_generator() -> None:
    topo = leaf_spine(8, 64, 8)
    assert topo.total_gpus == 4096
    assert len({n.leaf for n in topo.nodes}) == 8


def test_nodes_without_a_domain_label_are_their_own_domain() -> None:
    """GPU feature discovery labels `nvidia.com/gpu.clique` only on multi-node NVLink systems: with the
    domain key pointed at it, two GB200 trays of one clique share NVLink and an unlabelled HGX node is its
    own domain (not an error, not a member of another)."""
    keys = LabelKeys(domain="nvidia.com/gpu.clique")
    gb = {"kascade.io/leaf": "leaf-a", "kascade.io/nic-gbps": "400"}
    nodes = [
        {"metadata": {"name": n, "labels": {**gb, **extra}}, "status": {"allocatable": {"nvidia.com/gpu": "4"}}}
        for n, extra in (
            ("gb-1", {"nvidia.com/gpu.clique": "c0ffee.1"}),
            ("gb-2", {"nvidia.com/gpu.clique": "c0ffee.1"}),
            ("gb-3", {"nvidia.com/gpu.clique": "c0ffee.2"}),
            ("hgx-1", {}),
            ("hgx-2", {}),
        )
    ]
    topo = topology_from_nodes(nodes, keys, nvlink_gbps=900)
    assert topo.node("gb-1").domain == topo.node("gb-2").domain == "c0ffee.1"
    assert topo.node("hgx-1").domain == "hgx-1" and topo.node("hgx-2").domain == "hgx-2"
    assert topo.bandwidth_gbps("gb-1", "gb-2") == 900  # one clique: NVLink across trays
    assert topo.bandwidth_gbps("gb-1", "gb-3") == 400  # another clique: the NICs
    assert topo.bandwidth_gbps("hgx-1", "hgx-2") == 400
    empty = {**nodes[3], "metadata": {"name": "hgx-3", "labels": {**gb, "nvidia.com/gpu.clique": ""}}}
    assert topology_from_nodes([empty], keys).node("hgx-3").domain == "hgx-3"
