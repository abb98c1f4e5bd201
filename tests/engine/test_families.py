"""Real checkpoint families: a tiny random model of each (built offline by transformers, saved as a real
HF checkpoint, sharded or not, tied head or not) packs into blocks and the batched engine's greedy
tokens equal transformers' `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits
from kascade_engine.weights.blocks import pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_model

PROMPTS = [[5, 9, 13, 200, 3], [77], list(range(100, 140))]  # the last one runs past llama3's original context


def _hf_greedy(ckpt: Path, prompts: list[list[int]], n: int, **kw: object) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
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


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_greedy_equals_transformers(tmp_path: Path, family: str) -> None:
    """A window of 6 positions with 40-token prompts and chunked prefill (chunks cross the window): the
    engine's greedy tokens equal transformers'; the same weights without the window give other tokens,
    so the window is what the test checks. Mistral: every layer; Qwen2 (use_sliding_window,
    max_window_layers 1): layers 1.. only."""
    import json

    from kascade_engine.batch.families import sliding_windows

    ckpt = tiny_model(tmp_path / family, family, layers=3, window=6)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert sliding_windows(cfg) == ((6, 6, 6) if family == "mistral" else (None, 6, 6))
    blocks = pack_checkpoint(ckpt)
    prompts = [list(range(100, 140)), [5, 9, 13, 200, 3, 7, 11, 17, 19, 23], [77]]
    want = _hf_greedy(ckpt, prompts, 12)

    def greedy(cfg: dict[str, object]) -> list[list[int]]:
        m = LlamaModel(cfg)
        for b in blocks.blocks.values():
            m.add_block(b.id, b.tensors())
        return Engine(m, Limits(max_batch_tokens=16, kv_tokens=512, page_size=4)).generate_many(
            prompts, SamplingParams(max_tokens=12))

    assert greedy(blocks.config) == want
    assert greedy({**blocks.config, "sliding_window": None}) != want


def test_sliding_window_config_rules() -> None:
    from kascade_engine.batch.families import FamilyError, sliding_windows

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "sliding_window": 8}
    assert sliding_windows({**base, "architectures": ["LlamaForCausalLM"]}) == (None,) * 3
    assert sliding_windows({**base, "architectures": ["MistralForCausalLM"]}) == (8,) * 3
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "max_window_layers": 2}
    assert sliding_windows(qwen) == (None,) * 3  # use_sliding_window false: full attention, as transformers
    assert sliding_windows({**qwen, "use_sliding_window": True}) == (None, None, 8)
    types = ["full_attention", "sliding_attention", "full_attention"]
    assert sliding_windows({**qwen, "use_sliding_window": True, "layer_types": types}) == (None, 8, None)
    with pytest.raises(FamilyError, match="layer_types"):
        sliding_windows({**qwen, "use_sliding_window": True, "layer_types": ["full_attention"]})
    with pytest.raises(FamilyError, match="sliding_window"):
        sliding_windows({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 0})


def test_sliding_window_frees_pages_outside_the_window(tmp_path: Path) -> None:
    """Mistral (every layer windowed, W=6), pages of 4 slots, a KV cache of only 48 tokens: one request
    generates 150 tokens (3x the cache) with greedy == transformers, the sequence never holds more pages
    than its window plus one chunk needs, dropped pages return to the pool, and a model with a
    full-attention layer reclaims nothing (its table is shared by every layer)."""
    ckpt = tiny_model(tmp_path / "mistral", "mistral", layers=2, window=6)
    blocks = pack_checkpoint(ckpt)
    prompt = [5, 9, 13, 200, 3, 7, 11, 17, 19, 23, 29, 31, 37]
    want = _hf_greedy(ckpt, [prompt], 150, eos_token_id=None)[0]  # the engine here has no eos either

    def engine(cfg: dict[str, object]) -> Engine:
        m = LlamaModel(cfg)
        for b in blocks.blocks.values():
            m.add_block(b.id, b.tensors())
        return Engine(m, Limits(max_batch_tokens=8, kv_tokens=48, page_size=4))

    eng = engine(blocks.config)
    assert eng.scheduler.window == 6
    rid = eng.submit(prompt, SamplingParams(max_tokens=150))
    got: list[int] = []
    held: list[int] = []
    done = False
    while not done:
        for e in eng.step():
            got.append(e.token)
            done |= e.finished
        held.append(eng.scheduler.pool.held(rid))
        assert eng.scheduler.pool.used_pages == held[-1]  # dropped pages are free again
    assert got == want
    assert max(held) <= 5  # positions c-5 .. c+7 of a chunk at c: 13 positions span at most 5 pages
    assert held[-2] <= 3  # decoding: positions c-5 .. c span at most 3 pages
    assert eng.scheduler.dropped_pages >= (len(prompt) + 150 - 12) // 4
    assert eng.scheduler.pool.used_pages == 0

    qwen = tiny_model(tmp_path / "qwen2", "qwen2", layers=2, window=6)  # layer 0 attends to everything
    m = LlamaModel(pack_checkpoint(qwen).config)
    assert Engine(m, Limits(kv_tokens=48, page_size=4)).scheduler.window is None
    with pytest.raises(ValueError, match="exceeds the KV capacity of 48 tokens"):
        Engine(m, Limits(kv_tokens=48, page_size=4)).submit(prompt, SamplingParams(max_tokens=150))
