"""Shared fixtures: the real local control plane (session), fake GPU nodes, a namespace per test."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from kascade_devcluster import nodes
from kascade_devcluster.api import install_crds
from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.requirement import unavailable

_counter = itertools.count()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        bins = bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    cp = ControlPlane(tmp_path_factory.mktemp("controlplane"), bins).start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> list[str]:
    """Kascade's CRDs installed (and Established) on the session's control plane."""
    return install_crds(control_plane)


@pytest.fixture
def kwok_nodes(control_plane: ControlPlane) -> Iterator[Callable[..., list[str]]]:
    """Factory: make_nodes(n, gpus=8, leaves=2) -> names of Ready fake GPU nodes (deleted after the test).

    Nodes spread round-robin over `leaves` leaf switches, one scale-up domain each; `leaf=` puts them
    all under one named leaf, `domain=` puts them all in one scale-up (NVLink) domain.
    """
    sets: list[str] = []

    def make_nodes(n: int, gpus: int = 8, leaves: int = 2, nic_gbps: int = 100, *,
                   leaf: str | None = None, domain: str | None = None) -> list[str]:
        fake_set = f"t{next(_counter)}"
        sets.append(fake_set)
        specs = nodes.topology_specs(n, gpus, leaves, prefix=f"gpu-{fake_set}", nic_gbps=nic_gbps)
        specs = [replace(s, leaf=leaf or s.leaf, domain=domain or s.domain) for s in specs]
        return nodes.create_nodes(control_plane, specs, fake_set)

    yield make_nodes
    for s in sets:
        nodes.delete_nodes(control_plane, s)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"test-{next(_counter)}"
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
