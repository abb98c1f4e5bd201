"""Real checkpoint families: a tiny random model of each (built offline by transformers, saved as a real
HF checkpoint, sharded or not, tied head or not) packs into blocks and the batched engine's greedy
tokens equal transformers' `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kascade_engine.blocks import pack_checkpoint
from kascade_engine.checkpoint import tiny_model
from kascade_engine.engine import Engine
from kascade_engine.model import LlamaModel
from kascade_engine.sampling import SamplingParams
from kascade_engine.scheduler import Limits

PROMPTS = [[5, 9, 13, 200, 3], [77], list(range(100, 140))]  # the last one runs past llama3's original context


def _hf_greedy(ckpt: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize(("family", "tie", "shard"), [
    ("llama", True, None), ("llama3", False, None), ("mistral", False, 40_000), ("qwen2", True, None),
    ("qwen3", False, 60_000)])
def test_family_greedy_equals_transformers(tmp_path: Path, family: str, tie: bool, shard: int | None) -> None:
    ckpt = tiny_model(tmp_path / family, family, layers=3, tie=tie, shard_bytes=shard)
    assert (ckpt / "model.safetensors.index.json").exists() == bool(shard)
    blocks = pack_checkpoint(ckpt)
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    want = _hf_greedy(ckpt, PROMPTS, 12)
    assert len({tuple(w) for w in want}) == len(PROMPTS)
    got = Engine(m, Limits(max_batch_tokens=16, kv_tokens=512, page_size=8)).generate_many(
        PROMPTS, SamplingParams(max_tokens=12))
    assert got == want, family
