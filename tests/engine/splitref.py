"""Shared by the split-execution tests (pair, pipeline, disaggregated): the unsplit reference output
and a request's token stream. Importable because conftest.py puts this folder on sys.path."""

from __future__ import annotations

from typing import Any

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.instance import EngineInstance


def unsplit(blocks: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """What one engine holding the whole model generates, prompt by prompt."""
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return [Engine(m).generate(p, params) for p in prompts]


async def collect(inst: EngineInstance, rid: str) -> list[int]:
    """Every token of request `rid` on `inst`, in order."""
    return [ev.token async for ev in inst.serving.tokens(rid)]

