"""The persistent decode batch (batch/decodebatch.py): advanced in place, it holds exactly what `build_batch` makes
from the lists, step after step (pages opened, rows joining and leaving), and an engine using it generates the
same tokens as one that rebuilds every step."""

from __future__ import annotations

from typing import Any

import torch

from kascade_engine.batch.decodebatch import DecodeBatch
from kascade_engine.batch.engine import Engine
from kascade_engine.batch.kvcache import ForwardBatch, KVCache, build_batch
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.pages import PagePool
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits


def _same(got: ForwardBatch, want: ForwardBatch) -> None:
    assert got.decode is not None and want.decode is not None
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.slots, want.slots)
    assert got.max_position == want.max_position
    assert torch.equal(got.decode.tables, want.decode.tables)
    assert torch.equal(got.decode.lens, want.decode.lens)
    for window in (None, 5):
        assert torch.equal(got.decode.bias_for(window, torch.float32), want.decode.bias_for(window, torch.float32))


def test_advanced_in_place_it_equals_the_batch_built_from_the_lists() -> None:
    ps = 4
    cache = KVCache(1, 64, ps, 2, 4, torch.float32, torch.device("cpu"))
    pool = PagePool(64, ps)
    pos = {"a": 3, "b": 9, "c": 0}  # "c" opens a page on its first decode
    for rid, p in pos.items():
        pool.grow(rid, p + 1)
    db = DecodeBatch(cache)
    rows = ["a", "b", "c"]
    for step in range(14):
        if step == 6:
            rows = ["a", "c"]  # "b" finished: the row set changes
        if step == 9:
            pos["d"] = 2
            pool.grow("d", 3)
            rows = ["a", "c", "d"]  # a sequence joins
        items = [(pool.tables[r], pos[r], 1) for r in rows]
        _same(db.forward_batch(items), build_batch(cache, items))
        for r in rows:
            pos[r] += 1
            pool.grow(r, pos[r] + 1)
    assert db.rebuilds < 14 // 2  # mostly advanced in place (rebuilt on a new row set or more pages)


def test_a_row_not_one_step_on_is_rebuilt() -> None:
    cache = KVCache(1, 16, 4, 1, 2, torch.float32, torch.device("cpu"))
    pool = PagePool(16, 4)
    pool.grow("a", 8)
    db = DecodeBatch(cache)
    db.forward_batch([(pool.tables["a"], 2, 1)])
    items = [(pool.tables["a"], 4, 1)]  # two steps on (a step that did not come here)
    _same(db.forward_batch(items), build_batch(cache, items))
    assert db.rebuilds == 2


def _engine(blocks: Any, persistent: bool) -> Engine:
    m = LlamaModel(blocks.config)
    e = Engine(m, Limits(max_batch_tokens=64, max_seqs=6, kv_tokens=1024, page_size=4))
    e.load_blocks(blocks.blocks.values())
    if not persistent:
        e.decoding = None
    return e


def test_an_engine_with_it_generates_the_tokens_of_one_rebuilding_every_step(tiny_blocks: Any) -> None:
    # different prompt and output lengths: rows join (prefills between decode steps) and leave at different steps
    prompts = [[(3 * i + j) % 400 + 1 for j in range(2 + 3 * i)] for i in range(6)]
    want: list[list[int]] = []
    got: list[list[int]] = []
    for persistent, out in ((False, want), (True, got)):
        e = _engine(tiny_blocks, persistent)
        rids = [e.submit(p, SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
        toks: dict[str, list[int]] = {r: [] for r in rids}
        while e.requests:
            for ev in e.step():
                toks[ev.request].append(ev.token)
        out.extend(toks[r] for r in rids)
        if persistent:
            assert e.decoding is not None and 0 < e.decoding.rebuilds < e.steps // 2
    assert got == want
    assert [len(t) for t in got] == [5 + 3 * i for i in range(6)]


def test_the_sampled_ids_feed_the_next_step_on_the_device(tiny_blocks: Any) -> None:
    # a plain greedy all-decode step's argmax is the next step's input while the rows stay: no ids list -> tensor;
    # a row aborted mid-run and rows finishing at different steps make the batch rebuild (the carry is dropped)
    prompts = [[(5 * i + j) % 400 + 1 for j in range(3 + 2 * i)] for i in range(5)]
    runs: list[list[list[int]]] = []
    carried: list[torch.Tensor | None] = [None]  # the argmax kept by the step before the one running
    for persistent in (False, True):
        e = _engine(tiny_blocks, persistent)
        embed, fed = e.model.embed, list[bool]()

        def spy(ids: torch.Tensor, embed: Any = embed, fed: list[bool] = fed) -> torch.Tensor:
            fed.append(ids is carried[0])  # _hidden took the previous step's argmax as this step's ids
            return embed(ids)

        e.model.embed = spy  # type: ignore[method-assign]
        rids = [e.submit(p, SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
        toks: dict[str, list[int]] = {r: [] for r in rids}
        while e.requests:
            if e.steps == 9:
                e.abort(rids[3])
            carried[0] = e._carry
            for ev in e.step():
                toks[ev.request].append(ev.token)
        runs.append([toks[r] for r in rids])
        assert any(fed) == persistent  # the carry is used with the decode batch, never without it
    assert runs[1] == runs[0]
    assert [len(t) for i, t in enumerate(runs[1]) if i != 3] == [6, 8, 10, 14]
