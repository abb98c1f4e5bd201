"""Our layer-wise Llama against transformers' LlamaForCausalLM, and split runs against whole runs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from kascade_engine.batch.kvcache import SequenceKV
from kascade_engine.batch.model import LlamaModel


def _model(blocks) -> LlamaModel:
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return m


def test_logits_match_transformers(tiny_ckpt, tiny_blocks) -> None:
    ref = LlamaForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([3, 17, 250, 9, 44, 101, 7])
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    m = _model(tiny_blocks)
    kv = SequenceKV()
    got = m.logits(m.run_layers(0, m.shape.layers, m.embed(ids), kv, 0))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # incremental decode with the KV cache gives the same next-position logits as a full pass
    nxt = torch.tensor([int(got[-1].argmax())])
    step = m.logits(m.run_layers(0, m.shape.layers, m.embed(nxt), kv, len(ids)))
    with torch.no_grad():
        full = ref(torch.cat([ids, nxt])[None]).logits[0, -1]
    assert torch.allclose(step[0], full, atol=1e-4)


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_split_layers_bit_identical(tiny_blocks, k: int) -> None:
    m = _model(tiny_blocks)
    ids = torch.tensor([5, 6, 7, 8])
    whole = m.run_layers(0, 4, m.embed(ids), SequenceKV(), 0)
    kv_b, kv_a = SequenceKV(), SequenceKV()
    h = m.run_layers(0, k, m.embed(ids), kv_b, 0)
    split = m.run_layers(k, 4, h, kv_a, 0)
    assert torch.equal(whole, split)
    assert set(kv_b.layers) == set(range(k)) and set(kv_a.layers) == set(range(k, 4))


def test_missing_block_is_named(tiny_blocks) -> None:
    m = LlamaModel(tiny_blocks.config)
    m.add_block("embed", tiny_blocks.blocks["embed"].tensors())
    m.add_block("layer.0", tiny_blocks.blocks["layer.0"].tensors())
    assert m.resident_prefix() == 1 and not m.complete
    with pytest.raises(RuntimeError, match=r"layer\.1 is not resident"):
        m.run_layers(0, 2, m.embed(torch.tensor([1])), SequenceKV(), 0)


def test_bad_config_names_field() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaModel({"num_attention_heads": 2})
