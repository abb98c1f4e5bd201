"""Operator test setup: makes `builders` (spec/pod helpers) importable from the test modules
(pytest runs in importlib mode, so the test folder is not on sys.path by itself), and the `op` fixture:
the operator as a real process on the test's control plane, with the engine token the test module names
as `TOKEN` (its engine stubs use the same one)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def op(request: pytest.FixtureRequest, control_plane: ControlPlane, crds: list[str], namespace: str,
       tmp_path: Path) -> Iterator[OperatorProcess]:
    token = request.module.TOKEN  # each module's stubs check their own token
    o = OperatorProcess(control_plane, namespace, token, tmp_path / "operator.log")
    yield o
    o.stop()
    print(o.tail())
