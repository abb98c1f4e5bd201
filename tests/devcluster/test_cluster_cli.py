"""`kascade cluster up|status|down` as a person runs it: processes outlive the command, down stops them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kascade_devcluster import processes
from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.requirement import unavailable


def kascade(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kascade_cli.main", *args], capture_output=True, text=True, timeout=180
    )


def test_down_without_cluster_is_a_clear_error(tmp_path: Path) -> None:
    out = kascade("cluster", "down", "--state-dir", str(tmp_path))
    assert out.returncode == 1
    assert "no control plane state" in out.stderr


def test_up_rejects_bad_flag_values(tmp_path: Path) -> None:
    out = kascade("cluster", "up", "--state-dir", str(tmp_path), "--leaves", "0")
    assert out.returncode == 2
    assert "--leaves" in out.stderr


@pytest.mark.cluster
def test_up_status_down(tmp_path: Path) -> None:
    try:
        bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    up = kascade("cluster", "up", "--state-dir", str(tmp_path), "--nodes", "3", "--gpus-per-node", "4")
    assert up.returncode == 0, up.stderr
    assert "3 fake GPU nodes Ready" in up.stdout
    state = json.loads((tmp_path / "state.json").read_text())
    pids = list(state["pids"].values())
    try:
        assert all(processes.alive(p) for p in pids)  # they outlived `kascade cluster up`
        status = kascade("cluster", "status", "--state-dir", str(tmp_path))
        assert status.stdout.count("running") == 5, status.stdout
    finally:
        down = kascade("cluster", "down", "--state-dir", str(tmp_path))
    assert down.returncode == 0, down.stderr
    assert not any(processes.alive(p) for p in pids)
