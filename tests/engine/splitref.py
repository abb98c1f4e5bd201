"""Shared by the split-execution tests (pair, pipeline, disaggregated): the unsplit reference output
and a request's token stream. Importable because conftest.py puts this folder on sys.path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kascade_engine.engine import Engine
from kascade_engine.instance import EngineInstance
from kascade_engine.model import LlamaModel
from kascade_engine.sampling import SamplingParams


def unsplit(blocks: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """What one engine holding the whole model generates, prompt by prompt."""
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return [Engine(m).generate(p, params) for p in prompts]


async def collect(inst: EngineInstance, rid: str) -> list[int]:
    """Every token of request `rid` on `inst`, in order."""
    return [ev.token async for ev in inst.serving.tokens(rid)]


async def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether `cond` holds within `timeout_s`. Tokens reach clients as they land mid-step, and a head keeps
    steps out ahead, so the last frames can still be crossing the hops when every client is done."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()
