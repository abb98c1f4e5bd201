"""Fixtures: a tiny random Llama packed into blocks, shared by the data-plane tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kascade_engine.weights.blocks import BlockSet


@pytest.fixture(scope="session")
def harness() -> ModuleType:
    """harness.py, for the tests that take it as a fixture (others import it by name)."""
    import harness as dp_harness

    return dp_harness


@pytest.fixture(scope="session")
def netlab() -> ModuleType:
    """bench/netlab.py (namespaces joined by tbf/htb links), or a skip naming what this machine lacks (root,
    namespaces with tc)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root (ip netns, tc)")
    spec = importlib.util.spec_from_file_location("dp_netlab", Path(__file__).parents[2] / "bench" / "netlab.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    why = mod.available()
    if why is not None:
        pytest.skip(f"no namespaces with tc here: {why}")
    return mod


@pytest.fixture(scope="session")
def tiny_blocks(tmp_path_factory: pytest.TempPathFactory, harness: ModuleType) -> BlockSet:
    path = harness.tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", layers=6, hidden=128)
    return harness.packed(path)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory, harness: ModuleType) -> dict[str, Path]:
    """A test CA with a peer certificate, and a rogue CA with its own (openssl CLI; hack/install.sh installs it)."""
    from kascade_devcluster.peercerts import make_peer_certs

    return make_peer_certs(tmp_path_factory.mktemp("pki"))
