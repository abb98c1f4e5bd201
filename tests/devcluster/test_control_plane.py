"""The real local control plane: versions, fake GPU nodes, scheduling, controllers, clean teardown."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kascade_devcluster import processes
from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.nodes import KWOK_TOLERATION
from kascade_devcluster.requirement import unavailable

pytestmark = pytest.mark.cluster


def test_apiserver_reports_pinned_version(control_plane: ControlPlane) -> None:
    out = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"].startswith("v1.3")
    assert out["serverVersion"]["gitVersion"] != "v0.0.0-master+$Format:%H$"
    assert out["serverVersion"]["gitVersion"] == out["clientVersion"]["gitVersion"]


def test_kwok_nodes_ready_with_topology(control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]]) -> None:
    names = kwok_nodes(3, gpus=4, leaves=2)
    items = json.loads(control_plane.kubectl("get", "nodes", *names, "-o", "json").stdout)["items"]
    assert sorted(i["metadata"]["name"] for i in items) == sorted(names)
    for node in items:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    labels = {i["metadata"]["name"]: i["metadata"]["labels"] for i in items}
    assert sorted(v["kascade.io/leaf"] for v in labels.values()) == ["leaf-0", "leaf-0", "leaf-1"]
    assert len({v["kascade.io/scaleup-domain"] for v in labels.values()}) == 3  # one NVLink domain per node
    assert {v["kascade.io/nic-gbps"] for v in labels.values()} == {"100"}


def test_kwok_nodes_in_one_named_leaf_and_domain(control_plane: ControlPlane,
                                                 kwok_nodes: Callable[..., list[str]]) -> None:
    names = kwok_nodes(2, gpus=4, leaf="leaf-7", domain="nvl-0")
    got = control_plane.kubectl("get", "nodes", *names, "-o",
                                "jsonpath={range .items[*]}{.metadata.labels.kascade\\.io/leaf} "
                                "{.metadata.labels.kascade\\.io/scaleup-domain}{'\\n'}{end}").stdout
    assert got.split("\n")[:2] == ["leaf-7 nvl-0"] * 2


def _pod(name: str, ns: str, gpus: int) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"tolerations": [KWOK_TOLERATION],
                     "containers": [{"name": "engine", "image": "kascade/engine:dev",
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_scheduler_places_gpu_pod_and_it_runs(control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]],
                                              namespace: str) -> None:
    names = kwok_nodes(2, gpus=2)
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(_pod("fits", namespace, 2)))
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(_pod("too-big", namespace, 3)))
    control_plane.kubectl(
        "-n", namespace, "wait", "--for=jsonpath={.status.phase}=Running", "pod/fits", "--timeout=60s"
    )
    pod = json.loads(control_plane.kubectl("-n", namespace, "get", "pod", "fits", "-o", "json").stdout)
    assert pod["spec"]["nodeName"] in names
    # A pod asking for more GPUs than any node has stays Pending: the scheduler really counts GPUs.
    time.sleep(1.0)
    big = json.loads(control_plane.kubectl("-n", namespace, "get", "pod", "too-big", "-o", "json").stdout)
    assert big["status"]["phase"] == "Pending"
    assert "nodeName" not in big["spec"]


def test_deployment_creates_pods_through_controller_manager(
    control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]], namespace: str
) -> None:
    kwok_nodes(1, gpus=8)
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "pool", "namespace": namespace},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "pool"}},
            "template": {"metadata": {"labels": {"app": "pool"}}, "spec": _pod("x", namespace, 1)["spec"]},
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(dep))
    control_plane.kubectl("-n", namespace, "rollout", "status", "deployment/pool", "--timeout=60s")
    pods = json.loads(control_plane.kubectl("-n", namespace, "get", "pods", "-l", "app=pool", "-o", "json").stdout)[
        "items"
    ]
    assert len(pods) == 3
    assert {p["status"]["phase"] for p in pods} == {"Running"}


def test_stop_leaves_no_processes(tmp_path: Path) -> None:
    try:
        bins = bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    cp = ControlPlane(tmp_path, bins).start(scheduling=False, kwok=False)
    pids = dict(cp.pids)
    assert set(pids) == {"etcd", "kube-apiserver"}
    assert all(processes.alive(p) for p in pids.values())
    cp.stop()
    assert not any(processes.alive(p) for p in pids.values())
    assert not (tmp_path / "state.json").exists()


def test_component_crash_at_start_is_reported_and_nothing_leaks(tmp_path: Path) -> None:
    try:
        real = bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "etcd").symlink_to(real / "etcd")
    (bins / "kube-apiserver").write_text("#!/bin/sh\necho 'E0101 bad flag --etcd-servers' >&2\nexit 1\n")
    (bins / "kube-apiserver").chmod(0o755)
    cp = ControlPlane(tmp_path / "state", bins)
    with pytest.raises(RuntimeError, match="kube-apiserver exited during start-up") as e:
        cp.start(scheduling=False, kwok=False, timeout=20)
    assert "bad flag --etcd-servers" in str(e.value)  # the log tail travels with the error
    assert cp.pids == {}
    etcd_procs = [
        p
        for p in Path("/proc").glob("[0-9]*")
        if _cmdline(p).startswith(str(bins / "etcd")) or str(tmp_path) in _cmdline(p)
    ]
    assert etcd_procs == []
    assert not (tmp_path / "state" / "state.json").exists()


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _renew_times(cp: ControlPlane, node: str, seconds: float) -> list[str]:
    """The distinct renewTimes of the node's Lease seen over `seconds`."""
    seen: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out = cp.kubectl("-n", "kube-node-lease", "get", "lease", node, "-o", "jsonpath={.spec.renewTime}",
                         check=False).stdout
        if out and out not in seen:
            seen.append(out)
        time.sleep(0.5)
    return seen


def test_node_lease_duration_sets_how_often_kwok_renews(tmp_path: Path) -> None:
    """The knob a fleet-scale benchmark relaxes (KWOK renews every quarter of the Lease duration, like a kubelet):
    with 8 s a node's Lease is renewed every ~2 s, with 120 s not once in the same 9 s."""
    try:
        bins = bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    counts = {}
    for lease in (8, 120):
        cp = ControlPlane(tmp_path / f"l{lease}", bins).start(scheduling=False, node_lease_s=lease, node_grace_s=900)
        try:
            from kascade_devcluster.nodes import NodeSpec, create_nodes

            (name,) = create_nodes(cp, [NodeSpec(f"lease-{lease}")], "lease")
            _renew_times(cp, name, 3)  # the Lease exists and has its first renewal
            counts[lease] = len(_renew_times(cp, name, 9))
        finally:
            cp.stop()
    assert counts[8] >= 3, counts  # ~4 renewals in 9 s
    assert counts[120] <= 1, counts  # the value seen at the start only
