"""A loading engine keeps two steps out on its pair (cooperation.PIPELINE_DEPTH): while A runs step i's
layers, B runs step i+1's prefix for other sequences. Sequences out on A are parked in B's scheduler;
outputs stay exact. Plus the pieces: park/unpark, the emulated accelerator's knee, ZigZag batches."""

from __future__ import annotations

import asyncio

import torch
from splitref import collect, unsplit  # type: ignore[import-not-found]
from test_pair import PROMPTS, _pair  # type: ignore[import-not-found]

from kascade_engine.cooperation import PIPELINE_DEPTH, Row, staggered
from kascade_engine.kvcache import KVCache
from kascade_engine.livepolicy import ZigZagPolicy
from kascade_engine.sampling import SamplingParams
from kascade_engine.scheduler import Limits, Scheduler, Seq
from kascade_planner.engine_api import CooperateRequest
from kascade_planner.zigzag import PairSetting


async def test_b_keeps_two_steps_out_and_stays_exact(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=6)
    first, second = PROMPTS, [list(reversed(p)) for p in PROMPTS]
    want = unsplit(tiny_blocks, first + second, params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=2)
    try:
        a, b = p.a, p.b
        a.host.layer_s = 0.02  # A's step takes >= 4 x 20 ms: B's next step is ready while one is out
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        wave1 = [b.serving.submit(pr, params) for pr in first]
        runs = [asyncio.create_task(collect(b, r)) for r in wave1]
        await asyncio.sleep(0.03)  # the first wave's step is out on A when the second arrives
        wave2 = [b.serving.submit(pr, params) for pr in second]
        out = await asyncio.gather(*runs, *(collect(b, r) for r in wave2))
        assert out == want
        pc = b.pair
        assert pc is not None and pc.max_inflight == PIPELINE_DEPTH  # two steps out at once, never more
        assert not pc.inflight and not b.engine.scheduler.parked  # everything landed and unparked
        assert a.finisher.connections == 1  # still one connection for the pair
    finally:
        await p.close()


def test_parked_sequences_keep_their_seat_and_are_not_scheduled() -> None:
    s = Scheduler(Limits(max_batch_tokens=64, max_seqs=2, kv_tokens=256, page_size=16))
    s.add(Seq("a", 5, 4))
    s.add(Seq("b", 5, 4))
    s.add(Seq("c", 5, 4))
    assert [w.id for w in s.schedule().work] == ["a", "b"]
    s.advance("a", 5, False)
    s.park("a")  # its step is out on the pair
    s.advance("b", 5, True)
    assert [w.id for w in s.schedule().work] == ["b"]  # a is not scheduled, and c waits: a keeps its seat
    s.advance("b", 1, True)
    s.unpark("a")
    s.advance("a", 0, True)  # its token landed
    work = s.schedule().work
    assert {(w.id, w.start, w.n) for w in work} == {("a", 5, 1), ("b", 6, 1)}
    s.park("a")
    s.finish("a")  # aborted while out: gone, its seat free
    assert not s.parked and "a" not in s.running and not s.idle


def test_emulated_cost_is_per_full_batch_past_the_knee(tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """`staggered`'s cost (what `pace` charges): one layer time per layer run up to `knee_tokens` tokens
    present at it, proportionally more past it; without a knee, one per layer whatever the rows."""
    from kascade_engine.model import LlamaModel

    m = LlamaModel(tiny_blocks.config)
    for blk in tiny_blocks.blocks.values():
        m.add_block(blk.id, blk.tensors())
    L, H = m.shape.layers, m.shape.hidden
    pool = Scheduler(Limits(kv_tokens=512, page_size=16)).pool

    def rows(spec: list[tuple[str, int, int]]) -> list[Row]:  # (key, tokens, first layer); all run to L
        out = []
        for key, n, a in spec:
            assert pool.grow(key, n)
            out.append(Row(pool.tables[key], 0, n, a, L, torch.zeros(n, H, dtype=m.dtype)))
        return out

    cache = KVCache(L, 40, 16, m.shape.kv_heads, m.shape.head_dim, m.dtype, m.device)
    assert staggered(m, cache, rows([("a", 8, 0)]), knee_tokens=16) == L  # under the knee: one per layer
    # a full batch (16) plus 16 more tokens joining at layer 2: layers 0-1 cost 1, layers 2..L-1 cost 2
    assert staggered(m, cache, rows([("b", 16, 0), ("c", 16, 2)]), knee_tokens=16) == 2 + 2 * (L - 2)
    assert staggered(m, cache, rows([("d", 16, 0), ("e", 16, 2)])) == L  # no knee: rows are free


def test_zigzag_batches_group_requests_by_prompt_tokens() -> None:
    setting = PairSetting(layers=8, load_ratio=8.0, batches=12)
    per_request = ZigZagPolicy(setting)
    grouped = ZigZagPolicy(setting, batch_tokens=100)
    t = per_request.targets
    assert [per_request.next_target(0, 33) for _ in range(4)] == list(t[:4])  # one batch per request
    # 33-token prompts: three fill a 100-token batch, the fourth opens the next one
    assert [grouped.next_target(0, 33) for _ in range(7)] == [t[0]] * 3 + [t[1]] * 3 + [t[2]]
    assert grouped.admitted == 3
