"""Helm binary for chart tests (built by hack/build-control-plane.sh)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.requirement import unavailable

CHART = Path(__file__).resolve().parents[2] / "charts" / "kascade"


@pytest.fixture(scope="session")
def helm() -> Callable[..., subprocess.CompletedProcess[str]]:
    try:
        binary = bin_dir() / "helm"
    except MissingBinaries as e:
        unavailable(str(e))

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, check=check, timeout=120)

    return run
