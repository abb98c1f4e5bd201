"""docs/install.md §3 as a test: the chart's `topology.*` values reach the operator's settings and the
planner reads exactly those node labels. A GPU cluster labelled by NVIDIA GPU feature discovery
(`nvidia.com/gpu.clique` on multi-node NVLink trays only) plans NVLink inside a clique and the NICs
elsewhere, with the leaf/NIC keys pointed at the cluster's own labels."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kascade_operator.settings import OperatorSettings
from kascade_planner.topology import TopologyError, topology_from_nodes

CHART = Path(__file__).resolve().parents[2] / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]


def operator_env(helm: Helm, tmp: Path, values: dict[str, Any]) -> dict[str, str]:
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    docs = [
        d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(tmp / "values.yaml")).stdout) if d
    ]
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-operator")
    return {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}


def gpu_node(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true", **labels}},
            "status": {"allocatable": {"nvidia.com/gpu": "4", "cpu": "64"}}}


def test_gfd_clique_and_own_rack_labels_drive_the_planner(helm: Helm, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    env = operator_env(helm, tmp_path, {"topology": {  # the values docs/install.md §3 shows
        "scaleupDomainLabel": "nvidia.com/gpu.clique", "leafLabel": "example.com/rack",
        "nicGbpsLabel": "example.com/nic-gbps", "interLeafBandwidthRatio": 0.25}})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = OperatorSettings()
    keys = s.label_keys
    assert (keys.leaf, keys.domain, keys.nic_gbps) == (
        "example.com/rack",
        "nvidia.com/gpu.clique",
        "example.com/nic-gbps",
    )
    nodes = [
        gpu_node("gb-1", {"example.com/rack": "r1", "example.com/nic-gbps": "400", "nvidia.com/gpu.clique": "u.7"}),
        gpu_node("gb-2", {"example.com/rack": "r2", "example.com/nic-gbps": "400", "nvidia.com/gpu.clique": "u.7"}),
        gpu_node("hgx-1", {"example.com/rack": "r1", "example.com/nic-gbps": "200"}),
        gpu_node(
            "hgx-2", {"example.com/rack": "r2", "example.com/nic-gbps": "200", "kascade.io/scaleup-domain": "u.7"}
        ),
    ]  # the default key is no longer read
    topo = topology_from_nodes(nodes, keys, s.inter_leaf_ratio, nvlink_gbps=900)
    assert topo.bandwidth_gbps("gb-1", "gb-2") == 900  # same clique, different racks: NVLink
    assert topo.bandwidth_gbps("gb-1", "hgx-1") == 200  # same rack: the slower NIC
    assert topo.bandwidth_gbps("hgx-1", "hgx-2") == 50  # across racks: 200 x 0.25
    assert topo.node("hgx-2").domain == "hgx-2"
    # a GPU node without the configured rack label is refused by name (docs: label every GPU node)
    with pytest.raises(TopologyError, match=r"node 'gb-9': missing label 'example\.com/rack'"):
        topology_from_nodes([*nodes, gpu_node("gb-9", {"kascade.io/leaf": "l", "example.com/nic-gbps": "400"})], keys)
