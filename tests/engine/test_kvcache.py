"""The paged KV cache's gather: the engine's cache copies every step's K/V into one buffer kept across calls
(no fresh tensors per layer and step: kvcache.KVCache.gather), with the same values as fresh copies."""

from __future__ import annotations

import torch

from kascade_engine.batch.kvcache import KVCache


def _filled(reuse: bool) -> KVCache:
    c = KVCache(2, 9, 4, 2, 8, torch.float32, torch.device("cpu"), reuse_gather=reuse)
    g = torch.Generator().manual_seed(0)
    c.k[:, 1:] = torch.randn(c.k[:, 1:].shape, generator=g)
    c.v[:, 1:] = torch.randn(c.v[:, 1:].shape, generator=g)
    return c


def test_the_engines_gather_reuses_one_buffer_and_copies_the_same_values() -> None:
    kept, fresh = _filled(True), _filled(False)
    big = torch.tensor([[4, 5, 6, 7, 0], [8, 9, 10, 0, 0], [31, 30, 29, 28, 27]])  # 3 sequences, padded with slot 0
    small = torch.tensor([[12, 13]])
    for layer, index in ((0, big), (1, big), (1, small), (0, big)):
        k, v = kept.gather(layer, index)
        k0, v0 = fresh.gather(layer, index)
        assert k.shape == k0.shape == (index.shape[0], 2, index.shape[1], 8)
        assert torch.equal(k, k0) and torch.equal(v, v0)
        assert torch.equal(k[0, :, 0], kept.k[layer, int(index[0, 0])])  # [B, heads, C, dim]: slot's heads
    k1, _ = kept.gather(0, big)
    k2, _ = kept.gather(1, small)  # k1 still held: a fresh tensor could not sit at its address
    assert k2.data_ptr() == k1.data_ptr()  # the same buffer, not a new tensor per call
    assert kept.gather(0, torch.tensor([[1] * 20, [2] * 20]))[0].shape == (2, 2, 20, 8)  # a larger gather grows it
