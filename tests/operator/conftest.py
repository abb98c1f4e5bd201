"""Operator test setup: the `op` fixture,
the operator as a real process on the test's control plane, with the engine token the test module names
as `TOKEN` (its engine stubs use the same one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess


@pytest.fixture
def op(request: pytest.FixtureRequest, control_plane: ControlPlane, crds: list[str], namespace: str,
       tmp_path: Path) -> Iterator[OperatorProcess]:
    token = request.module.TOKEN  # each module's stubs check their own token
    o = OperatorProcess(control_plane, namespace, token, tmp_path / "operator.log")
    yield o
    o.stop()
    print(o.tail())
