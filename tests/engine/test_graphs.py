"""CUDA-graph decode (batch/graphs.py), the parts that run on the CPU: bucket and page-bucket choice, padding a
decode step to a graph's shape, and the padded forward a graph would capture giving the eager step's tokens
and logits. Capture and replay need a GPU (bench/gpu_smoke.py); off CUDA the engine has no graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.graphs import (
    DecodeGraphs,
    DecodeInputs,
    bucket_for,
    buckets,
    decode_forward,
    pad_decode,
    page_bucket,
)
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits


def test_buckets_cover_every_batch_up_to_max_seqs() -> None:
    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets(1) == (1,) and buckets(6) == (1, 2, 4, 6) and buckets(20) == (1, 2, 4, 8, 16, 20)
    sizes = buckets(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert bucket_for(21, sizes) is None  # more rows than any graph: the step runs eagerly
    with pytest.raises(ValueError, match="max_seqs"):
        buckets(0)
    with pytest.raises(ValueError, match=">= 1 row"):
        bucket_for(0, sizes)


def test_page_buckets_are_powers_of_two_capped() -> None:
    assert [page_bucket(p, 100) for p in (1, 2, 3, 4, 5, 9, 64, 65)] == [1, 2, 4, 4, 8, 16, 64, 100]
    assert page_bucket(5, 6) == 6
    with pytest.raises(ValueError, match="outside"):
        page_bucket(7, 6)


def test_pad_decode_keeps_real_rows_and_pads_with_page_zero() -> None:
    # two decodes, page size 4: a sequence at position 5 (pages 3, 7) and one at position 0 (page 9)
    x = pad_decode([11, 12], [([3, 7], 5, 1), ([9], 0, 1)], 4, bucket=4, pages=4)
    assert x.n == 2
    assert x.ids.tolist() == [11, 12, 0, 0]
    assert x.positions.tolist() == [5, 0, 0, 0]
    assert x.slots.tolist() == [7 * 4 + 1, 9 * 4, 0, 0]  # padding rows write slot 0 (reserved page 0)
    assert x.lens.tolist() == [6, 1, 1, 1]
    assert x.tables.tolist() == [[3, 7, 0, 0], [9, 0, 0, 0], [0] * 4, [0] * 4]
    assert all(t.device.type == "cpu" and t.dtype == torch.long for t in (x.ids, x.positions, x.slots, x.lens,
                                                                           x.tables))
    with pytest.raises(ValueError, match="decode steps only"):
        pad_decode([1], [([3], 0, 2)], 4, bucket=2, pages=1)
    with pytest.raises(ValueError, match="needs more than 1 pages"):
        pad_decode([1], [([3, 7], 5, 1)], 4, bucket=1, pages=1)
    with pytest.raises(ValueError, match="bucket of 1"):
        pad_decode([1, 2], [([3], 0, 1), ([4], 0, 1)], 4, bucket=1, pages=1)


class _EagerGraphs(DecodeGraphs):
    """The engine's graph planning as is; the graph's forward run eagerly on the CPU (what a capture records)."""

    ran: list[tuple[int, int]]

    def _run(self, x: DecodeInputs) -> torch.Tensor:
        self.ran.append(tuple(x.tables.shape))  # type: ignore[arg-type]
        return decode_forward(self.model, self.cache, x)


def _engine(blocks: Any, graphs: bool) -> Engine:
    m = LlamaModel(blocks.config)
    e = Engine(m, Limits(max_batch_tokens=256, max_seqs=8, kv_tokens=2048, page_size=4))
    assert e.graphs is None  # on the CPU: never
    e.load_blocks(blocks.blocks.values())
    if graphs:
        g = _EagerGraphs(m, e.cache, e.limits.max_seqs, e.limits.pages - 1)
        g.ran = []
        e.graphs = g
    return e


def test_padded_graph_forward_gives_the_eager_tokens(tiny_blocks: Any) -> None:
    prompts = [[(5 * i + j) % 500 + 1 for j in range(1 + 2 * i)] for i in range(5)]  # 5 rows: bucket 8
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = _engine(tiny_blocks, graphs=False).generate_many(prompts, params)
    e = _engine(tiny_blocks, graphs=True)
    assert e.generate_many(prompts, params) == eager
    ran = e.graphs.ran  # type: ignore[union-attr]
    assert ran and {b for b, _ in ran} == {8}  # every decode step went through the padded path, bucket 8
    assert {p for _, p in ran} == {4, 8} and len({p for _, p in ran}) > 1  # page buckets grew with context


def test_padded_logits_match_the_eager_step(tiny_blocks: Any) -> None:
    a, b = _engine(tiny_blocks, graphs=False), _engine(tiny_blocks, graphs=True)
    for e in (a, b):
        for i in range(3):
            e.submit([7 * i + j + 1 for j in range(6 + i)], SamplingParams(max_tokens=50, ignore_eos=True))
        while any(r.out == [] for r in e.requests.values()):  # prefill: eager in both
            e.step()
    work = a._schedule()
    ids = [a.requests[w.id].span(w.start, w.end)[0] for w in work]
    items = [(a.scheduler.pool.tables[w.id], w.start, w.n) for w in work]
    want = a._logits(work)
    got = b.graphs.logits(ids, items)  # type: ignore[union-attr]
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
