"""Pure parts of the local control plane: ports, kubeconfig, node manifests, state file errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kascade_devcluster import processes
from kascade_devcluster.controlplane import ControlPlane, StateError
from kascade_devcluster.kubeconfig import kubeconfig_text
from kascade_devcluster.nodes import KWOK_KEY, node_manifest, topology_specs
from kascade_devcluster.pki import make_pki
from kascade_devcluster.ports import free_ports


def test_free_ports_are_distinct_and_unprivileged() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 < p < 65536 for p in ports)
    # below the ephemeral range (an outgoing connection cannot hold one before the engine binds it),
    # and never handed out twice by this process
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(p < low for p in ports)
    assert not set(ports) & set(free_ports(8))
    with pytest.raises(ValueError, match="n must be"):
        free_ports(-1)


def test_kubeconfig_uses_token_and_ca(tmp_path: Path) -> None:
    cfg = yaml.safe_load(kubeconfig_text("https://127.0.0.1:6443", tmp_path / "ca.crt", "tok"))
    assert cfg["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": str(tmp_path / "ca.crt"),
    }
    assert cfg["users"][0]["user"] == {"token": "tok"}
    assert cfg["current-context"] == cfg["contexts"][0]["name"]


def test_topology_specs_spread_over_leaves() -> None:
    specs = topology_specs(5, gpus=4, leaves=2)
    assert [s.leaf for s in specs] == ["leaf-0", "leaf-1", "leaf-0", "leaf-1", "leaf-0"]
    assert {s.gpus for s in specs} == {4}
    with pytest.raises(ValueError, match="leaves >= 1"):
        topology_specs(2, leaves=0)


def test_node_manifest_is_kwok_managed_with_topology() -> None:
    m = node_manifest(topology_specs(1, gpus=8)[0], "s")
    meta = m["metadata"]
    assert isinstance(meta, dict)
    assert meta["annotations"][KWOK_KEY] == "fake"
    assert meta["labels"]["kascade.io/leaf"] == "leaf-0"
    assert meta["labels"]["kascade.io/nic-gbps"] == "100"
    status = m["status"]
    assert isinstance(status, dict)
    assert status["capacity"]["nvidia.com/gpu"] == "8"
    spec = m["spec"]
    assert isinstance(spec, dict)
    assert spec["taints"][0]["effect"] == "NoSchedule"


def test_state_round_trip(tmp_path: Path) -> None:
    cp = ControlPlane(tmp_path, tmp_path / "bin", 1234, "tok", {"etcd": 11, "kube-apiserver": 12})
    cp.save()
    back = ControlPlane.load(tmp_path)
    assert (back.api_port, back.token, back.pids, back.bin_dir) == (1234, "tok", cp.pids, tmp_path / "bin")


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no control plane state"), ("{not json", "not valid JSON"), (json.dumps({"pids": {}}), "malformed state")],
)
def test_bad_state_file_is_a_clear_error(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "state.json").write_text(content)
    with pytest.raises(StateError, match=message) as e:
        ControlPlane.load(tmp_path)
    assert "state.json" in str(e.value)


def test_start_refuses_when_a_live_control_plane_owns_the_state(tmp_path: Path) -> None:
    import os

    ControlPlane(tmp_path, tmp_path, 1, "t", {"etcd": os.getpid()}).save()  # a live pid
    with pytest.raises(StateError, match="is running"):
        ControlPlane(tmp_path, tmp_path).start()


def test_start_refuses_on_corrupt_state(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(StateError, match="remove it to start afresh"):
        ControlPlane(tmp_path, tmp_path).start()


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"], start_new_session=True)


def test_reused_pid_is_not_ours_and_never_signalled(tmp_path: Path) -> None:
    """A state file whose PID now belongs to another process (reboot, PID reuse) must not kill it."""
    other = _sleeper()
    try:
        real = processes.start_time(other.pid)
        assert real is not None
        assert processes.alive(other.pid, real)
        assert not processes.alive(other.pid, real + 1)
        ControlPlane(tmp_path, tmp_path, 1, "t", {"etcd": other.pid}, {"etcd": real + 1}).save()
        stale = ControlPlane.load(tmp_path)
        assert stale.running() == {"etcd": False}
        stale.stop()
        assert other.poll() is None  # still running: stop() left the stranger alone
        assert not (tmp_path / "state.json").exists()
    finally:
        other.kill()
        other.wait()


def test_state_with_matching_start_time_stops_the_process(tmp_path: Path) -> None:
    ours = _sleeper()
    started = processes.start_time(ours.pid)
    assert started is not None
    ControlPlane(tmp_path, tmp_path, 1, "t", {"etcd": ours.pid}, {"etcd": started}).save()
    cp = ControlPlane.load(tmp_path)
    assert cp.running() == {"etcd": True}
    cp.stop()  # stop() reaps its own child, so only absence can be checked, not the signal
    assert not Path(f"/proc/{ours.pid}").exists()
    ours.wait(timeout=5)


def test_zombie_counts_as_dead() -> None:
    # `sleep 0` becomes a child of `sleep 30` (after exec), which never reaps it: a zombie we cannot reap.
    parent = subprocess.Popen(["sh", "-c", "sleep 0 & echo $!; exec sleep 30"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        zombie = int(parent.stdout.readline())
        deadline = time.monotonic() + 5
        while Path(f"/proc/{zombie}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "child never became a zombie"
            time.sleep(0.02)
        assert not processes.alive(zombie)
        assert processes.alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()


def test_pki_server_cert_chains_to_ca_with_loopback_sans(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", extra_tokens={"operator": "op-tok"})
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(pki.ca_cert), str(pki.server_cert)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(pki.server_cert), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:localhost" in text
    lines = pki.tokens_csv.read_text().splitlines()
    assert lines[0] == f'{pki.admin_token},admin,admin-uid,"system:masters"'
    assert lines[1] == "op-tok,operator,uid-0"  # no group: RBAC decides what it may do
    assert len(pki.admin_token) == 32
    assert make_pki(tmp_path / "pki").admin_token == pki.admin_token  # reused, not regenerated


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_children_die_with_a_killed_interpreter(tmp_path: Path, die_with_parent: bool) -> None:
    """SIGKILL skips atexit; die_with_parent still takes the children down (and only then)."""
    code = ("import sys, time; from pathlib import Path; from kascade_devcluster import processes; "
            f"p = processes.start('sleeper', ['sleep', '30'], Path(sys.argv[1]), die_with_parent={die_with_parent}); "
            "print(p.pid, p.started, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid, started = (int(x) for x in parent.stdout.readline().split())
    try:
        assert processes.alive(pid, started)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while processes.alive(pid, started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.alive(pid, started) is (not die_with_parent)
    finally:
        processes.stop(pid, timeout=2, started=started)


def test_the_readiness_prober_folds_readiness_gates_into_ready_like_a_kubelet() -> None:
    from kascade_devcluster.enginepool import SERVING_GATE
    from kascade_devcluster.prober import gates_open
    from kascade_operator.labels import SERVING_GATE as OPERATOR_GATE

    assert SERVING_GATE == OPERATOR_GATE  # the harness repeats the operator's condition type
    gated = {"spec": {"readinessGates": [{"conditionType": SERVING_GATE}]}, "status": {"conditions": [
        {"type": "Ready", "status": "True"}]}}
    assert gates_open({"spec": {}, "status": {}})  # no gates: the probe alone decides
    assert not gates_open(gated)  # a gate never written is closed
    gated["status"]["conditions"].append({"type": SERVING_GATE, "status": "False"})
    assert not gates_open(gated)
    gated["status"]["conditions"][-1]["status"] = "True"
    assert gates_open(gated)


@pytest.mark.parametrize("lease, grace", [(0, 40), (160, 40), (4000, 900)])
def test_a_node_lease_renewed_slower_than_the_grace_is_refused(tmp_path: Path, lease: int, grace: int) -> None:
    """KWOK renews a node's Lease every quarter of its duration: a renewal period at or past the node controller's
    grace would mark every node NotReady between renewals."""
    with pytest.raises(ValueError, match=r"node_lease_s \(\d+\).*node_grace_s"):
        ControlPlane(tmp_path, tmp_path).start(node_lease_s=lease, node_grace_s=grace)
    assert not (tmp_path / "etcd").exists()  # refused before anything started
