"""The Kascade CRDs installed once per session into the real control plane."""

from __future__ import annotations

import pytest

from kascade_devcluster.api import install_crds
from kascade_devcluster.controlplane import ControlPlane


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> list[str]:
    return install_crds(control_plane)
