"""A loading engine keeps up to PIPELINE_DEPTH steps out on its pair (pairclient.PIPELINE_DEPTH): while A runs step i's
layers, B runs step i+1's prefix for other sequences. Sequences out on A are parked in B's scheduler;
outputs stay exact. Plus the pieces: park/unpark, the emulated accelerator's knee, ZigZag batches."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
import torch
from splitref import collect, unsplit
from test_pair import PROMPTS, _pair

from kascade_engine.batch.kvcache import KVCache
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits, Scheduler, Seq
from kascade_engine.live.cooperation import Row, staggered
from kascade_engine.live.livepolicy import ZigZagPolicy
from kascade_engine.live.pairclient import PIPELINE_DEPTH
from kascade_planner.engine_api import CooperateRequest
from kascade_planner.zigzag import PairSetting, ilp_free


async def test_b_keeps_its_steps_out_and_stays_exact(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=6)
    waves = [[list(reversed(p)) if w % 2 else p for p in PROMPTS] for w in range(PIPELINE_DEPTH + 1)]
    for w, wave in enumerate(waves):  # distinct prompts per wave
        wave[0] = [*wave[0], w]
    want = unsplit(tiny_blocks, [p for wave in waves for p in wave], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=2)
    try:
        a, b = p.a, p.b
        a.host.layer_s = 0.05  # A's step takes >= 4 x 50 ms: B's next steps are ready while earlier ones are out
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        runs = []
        for wave in waves:  # each wave arrives while the earlier waves' steps are out on A
            runs += [asyncio.create_task(collect(b, b.serving.submit(pr, params))) for pr in wave]
            await asyncio.sleep(0.03)
        out = await asyncio.gather(*runs)
        assert out == want
        pc = b.pair
        assert pc is not None and pc.max_inflight == PIPELINE_DEPTH  # that many steps out at once, never more
        for _ in range(200):  # tokens reach clients as they land (mid-step); the last frame may carry only ends
            if not pc.inflight:
                break
            await asyncio.sleep(0.01)
        assert not pc.inflight and not b.engine.scheduler.parked  # everything landed and unparked
        assert a.finisher.connections == 1  # still one connection for the pair
    finally:
        await p.close()


def test_a_paired_engine_starts_a_prompt_that_fits_a_step_whole() -> None:
    """Issue 17: on a loading engine each step of a split prompt is a pair round trip (its prefix here, A's
    step boundary, A's step), so with `whole_prompts` a waiting prompt that fits a step whole waits for the
    next step instead of being split across two (bench trace: request 40 took two round trips, 3.2 s).
    A prompt longer than a step still chunks; without the flag chunked prefill is unchanged."""
    def run(whole: bool) -> list[list[tuple[str, int, int]]]:
        s = Scheduler(Limits(max_batch_tokens=64, max_seqs=8, kv_tokens=1024, page_size=16))
        s.whole_prompts = whole
        for name, n in (("a", 40), ("b", 40), ("long", 100)):
            s.add(Seq(name, n, 4))
        steps = []
        for _ in range(4):
            b = s.schedule()
            steps.append([(w.id, w.start, w.n) for w in b.work])
            for w in b.work:
                s.advance(w.id, w.n, w.start + w.n == {"a": 40, "b": 40, "long": 100}[w.id])
        return steps

    assert run(False)[0] == [("a", 0, 40), ("b", 0, 24)]  # b split across two steps
    whole = run(True)
    assert whole[0] == [("a", 0, 40)]  # b (40) does not fit the 24 left: it waits, whole
    assert ("b", 0, 40) in whole[1]
    assert any(w[0] == "long" and w[2] < 100 for step in whole for w in step)  # longer than a step: chunks


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


def test_emulated_cost_is_per_full_batch_past_the_knee(tiny_blocks) -> None:
    """`staggered`'s cost (what `pace` charges): one layer time per layer run up to `knee_tokens` tokens
    present at it, proportionally more past it; without a knee, one per layer whatever the rows."""
    from kascade_engine.batch.model import LlamaModel

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
    """The queue ahead of a request, in prompt tokens, gives its batch: a request that fits the open batch
    gets that batch's prefix, one that does not opens the next; batch i's prefix is T_i of the plan for
    the i + 1 batches queued now (at load start here: nothing resident)."""
    setting = PairSetting(layers=8, load_ratio=8.0, batches=12)
    per_request = ZigZagPolicy(setting)
    grouped = ZigZagPolicy(setting, batch_tokens=100)
    t = [ilp_free(replace(setting, batches=i + 1)).target_layers[i] for i in range(4)]
    assert [per_request.next_target(0, 33, 33 * q, q) for q in range(4)] == t  # one batch per request
    # 33-token prompts: three fill a 100-token batch, the fourth opens the next one
    assert [grouped.next_target(0, 33, 33 * q, q) for q in range(7)] == [t[0]] * 3 + [t[1]] * 3 + [t[2]]
    fig15 = PairSetting(layers=7, load_ratio=6.0, batches=6)  # a queue there at t = 0: the t = 0 plan's T_i
    assert [ZigZagPolicy(fig15).next_target(0, 6, 6 * q, q) for q in range(6)] == list(ilp_free(fig15).target_layers)


def test_zigzag_replans_from_the_queue_as_it_is() -> None:
    """Issue 17: a request arriving to an engine with nothing queued is batch 0 of a one-batch plan made
    now, with the layers already here counted as loaded: it runs with what is resident (ILP-free) and is
    never held for layers a t = 0 plan reserved for a burst that did not queue. (The old policy gave the
    i-th admitted batch the t = 0 plan's T_i whatever the queue: here the second request waited for 2
    layers more than the one resident.)"""
    setting = PairSetting(layers=8, load_ratio=8.0, batches=12)
    t0_plan = ZigZagPolicy(setting).targets
    assert max(t0_plan[1:4]) > 1  # the t = 0 plan holds later batches for layers not resident yet
    lone = ZigZagPolicy(setting)
    assert [lone.next_target(r, 33) for r in (0, 1, 1, 3, 5)] == [0, 1, 1, 3, 5]
    # with a real queue ahead the plan can still hold: behind 2 batches, 1 layer here, a later batch waits
    queued = [ZigZagPolicy(setting).next_target(1, 33, 33 * q, q) for q in range(6)]
    assert queued == [ilp_free(replace(setting, batches=q + 1, elapsed=setting.load_ratio)).target_layers[q]
                      for q in range(6)]
    assert max(queued) > 1
    assert ZigZagPolicy(setting).next_target(1, 33, 33 * 12, 12) == 1  # past the horizon: the resident prefix


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40),
                                    SamplingParams(max_tokens=40, temperature=0.9, seed=11)], ids=["greedy", "seeded"])
async def test_split_sequences_migrate_to_b_once_it_holds_every_layer(tiny_ckpt, tiny_blocks, params) -> None:
    """Decode-state migration: sequences B started split finish on B alone once its last block lands. A
    hands over their K/V (and sampler state) and frees them; outputs equal the unsplit engine's."""
    want = unsplit(tiny_blocks, PROMPTS[:3], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        a, b = p.a, p.b
        a.host.layer_s = 0.005  # A's steps take a little time: generation is still going when layers land
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        rids = [b.serving.submit(pr, params) for pr in PROMPTS[:3]]
        runs = [asyncio.create_task(collect(b, r)) for r in rids]
        pc = b.pair
        assert pc is not None
        while pc.steps_sent < 5:  # a few tokens generated split
            await asyncio.sleep(0.005)
        assert a.host.lengths  # A holds their later layers
        for i in (1, 2, 3):
            b.add_block(tiny_blocks.blocks[f"layer.{i}"])
        b.add_block(tiny_blocks.blocks["head"])
        out = await asyncio.gather(*runs)
        assert out == want
        assert pc.migrated == 3 and a.host.migrated == 3  # every split sequence moved, none finished on A
        assert not a.host.lengths and not a.host.gens  # A freed them at once
        assert pc.steps_sent < 5 + params.max_tokens  # the rest of the decode ran on B alone
        assert b.engine.coop is b.host  # nothing split left: a plain engine again
    finally:
        await p.close()


def test_migrated_kv_is_checked_and_lands_in_the_right_slots(tiny_blocks) -> None:
    from kascade_engine.live import migration

    L = tiny_blocks.config.num_hidden_layers if hasattr(tiny_blocks.config, "num_hidden_layers") else 4
    src = KVCache(L, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    dst = KVCache(L, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    src.k.normal_()
    dst.k.zero_()
    dst.v.zero_()
    src.v.normal_()
    payload = migration.take(src, [3, 5], 1, 6)  # positions 0..5 live on pages 3 and 5 there
    assert len(payload) == migration.kv_bytes(src, L - 1, 6)
    migration.put(dst, [6, 2], 1, 6, memoryview(payload))  # and on pages 6 and 2 here
    here = torch.tensor([24, 25, 26, 27, 8, 9])
    there = torch.tensor([12, 13, 14, 15, 20, 21])
    for layer in range(1, L):
        assert torch.equal(dst.k[layer][here], src.k[layer][there]) and torch.equal(
            dst.v[layer][here], src.v[layer][there]
        )
    assert not dst.k[0][here].any()  # layers below k stay as they were
    with pytest.raises(ValueError, match="bytes"):
        migration.put(dst, [6, 2], 1, 5, memoryview(payload))
    with pytest.raises(ValueError, match="base64"):
        migration.set_gen_state(torch.Generator(), 42)


async def test_the_knee_flag_reaches_both_sides_of_a_pair(tiny_ckpt, tiny_blocks) -> None:
    """--emulate-knee-tokens sets the knee `pace` charges on A's hosted steps and on B's own."""
    from kascade_engine.config import EngineConfig
    from kascade_engine.instance import EngineInstance
    from kascade_engine.net.transport_tcp import TcpTransport
    from kascade_engine.tokenizer import ByteTokenizer

    def inst(name: str, resident: int | None) -> EngineInstance:
        cfg = EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token="pair-token", kv_tokens=2048,
                           max_batch_tokens=64, instance=name, resident_layers=resident, emulate_layer_ms=1.0,
                           emulate_knee_tokens=32)
        return EngineInstance(cfg, tiny_blocks.config, ByteTokenizer(), tiny_blocks)

    a, b = inst("a", None), inst("b", 1)
    a.serving.start()
    b.serving.start()
    listener = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    try:
        assert a.host.knee_tokens == 32 and a.host.layer_s == 0.001
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{listener.port}", "besteffort"))
        assert b.pair is not None and b.pair.knee_tokens == 32 and b.pair.layer_s == 0.001
    finally:
        await b.close()
        await a.close()
        await listener.close()


async def test_zigzag_serves_spread_out_requests_without_holding(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17: requests reaching a ZigZag B one after another (each done before the next comes) are each
    batch 0 of the queue as it is: they run at once with the resident layer, outputs exact. A t = 0 plan
    (the old policy) held the second for 3 layers that never land here (the request waited out the hold
    limit)."""
    setting = PairSetting(layers=4, load_ratio=2.0, batches=6)
    assert ZigZagPolicy(setting).targets[1] == 3  # what the t = 0 plan gives the second batch
    params = SamplingParams(max_tokens=4)
    want = unsplit(tiny_blocks, PROMPTS[:3], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        b = p.b
        await b.set_cooperate(CooperateRequest(p.peer, "zigzag"))
        assert b.pair is not None
        b.pair.policy = ZigZagPolicy(setting)
        assert b.serving_share == 1 / 4 and b.pair.peer_complete  # paired with a source: its own layers' share
        got = []
        for pr in PROMPTS[:3]:
            got.append(await asyncio.wait_for(collect(b, b.serving.submit(pr, params)), 10))
        assert got == want
        assert [k for _, k in b.pair.history] == [1, 1, 1]
        assert not b.pair.ahead and not b.pair.holding  # the queue it plans from is empty again
    finally:
        await p.close()


def test_an_answer_landing_inside_the_step_that_sent_it(tiny_blocks) -> None:
    """A live pair's answer can land inside the very forward that sent its step (A answered before B's step
    returned: PairClient lands every answer that is back). Engine.step must not re-read the request after
    the forward: before, a request finished by that landing was gone (KeyError, the whole step failed for
    everyone in it) and one that got its token looked like an unfinished prefill, so the next rows'
    tokens were taken one off (bench: `engine failed on this request: 'cmpl-…'`, wrong texts)."""
    from kascade_engine.batch.engine import Engine, Event
    from kascade_engine.batch.model import LlamaModel

    m = LlamaModel(tiny_blocks.config)
    eng = Engine(m, Limits(max_batch_tokens=64, max_seqs=4, kv_tokens=256, page_size=16))
    done_now = eng.submit([1, 2, 3], SamplingParams(max_tokens=1), "landed")  # its answer lands in the forward
    goes_on = eng.submit([4, 5], SamplingParams(max_tokens=2), "landed-2")  # same, not finished by it
    local = eng.submit([6, 7, 8, 9], SamplingParams(max_tokens=2), "local")  # sampled here, token 42

    class Stub:
        def __init__(self) -> None:
            self.events: list[Event] = []

        def pending(self) -> bool:
            return False

        def prepare(self, engine: Engine) -> None:
            pass

        def abort(self, rid: str) -> None:
            pass

        def take_events(self) -> list[Event]:
            out, self.events = self.events, []
            return out

        def forward(self, engine: Engine, work: list[Any]) -> list[int | None]:
            toks: list[int | None] = []
            for w in work:  # every chunk samples here (whole prompts)
                if w.id == local:
                    toks.append(42)
                else:  # its step went out and its answer is back already: landed as PairClient._land does
                    engine.scheduler.advance(w.id, 0, True)
                    self.events.append(engine.deliver(w.id, 7, 0.0))
                    toks.append(None)
            return toks

    eng.coop = Stub()
    events = eng.step()
    got = {(e.request, e.token, e.finished) for e in events}
    assert got == {(done_now, 7, True), (goes_on, 7, False), (local, 42, False)}
    assert eng.requests[local].out == [42] and eng.requests[goes_on].out == [7]
    s = eng.scheduler.running[goes_on]
    assert (s.computed, s.total) == (2, 3)  # its prompt cached, one token generated: the same as landing later


@pytest.mark.parametrize("b_paced", [False, True], ids=["b-instant", "b-paced"])
async def test_b_rows_join_a_running_step_at_their_layer(tiny_ckpt, tiny_blocks, b_paced: bool) -> None:
    """Issue 17: a B step that reaches A while A's forward has not yet passed B's split layer k joins that
    forward at layer k (cooperation.staggered's `join`), instead of waiting for A's next step boundary.
    A is kept busy by a long request of its own, so each of B's frames (sent right after the last token
    landed) reaches A just after A's next step began: with the join each B token costs one A step, without
    it two (the frame waited out the step it arrived in). With B's prefix paced like A's layers (b-paced)
    the frame reaches A while A runs layer k itself: its rows catch up that layer alone and still finish
    in this step (CATCH_UP_LAYERS). Outputs stay exact on both engines."""
    params = SamplingParams(max_tokens=5)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=2)
    try:
        a, b = p.a, p.b
        a.host.layer_s = 0.08  # A's step: 4 layers x 80 ms; B's rows start at layer 2 (160 ms into it)
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        assert b.pair is not None
        b.pair.layer_s = 0.08 if b_paced else 0.0  # paced: B's 2-layer prefix takes as long as A's layers 0-1
        long = a.serving.submit(PROMPTS[3], SamplingParams(max_tokens=400))  # keeps A stepping throughout
        a_run = asyncio.create_task(collect(a, a.serving.submit(PROMPTS[1], params)))
        while a.engine.steps < 2:
            await asyncio.sleep(0.01)
        before = a.engine.steps
        got = await asyncio.wait_for(collect(b, b.serving.submit(PROMPTS[0], params)), 30)
        spent = a.engine.steps - before
        a.serving.abort(long)
        assert got == want[0] and await a_run == want[1]
        # one A step per B token (+ the step running as B's request came in); waiting for boundaries: ~2 each
        assert spent <= params.max_tokens + 2, f"{spent} A steps for {params.max_tokens} B tokens"
        assert a.host.joined >= params.max_tokens - 1  # frames joined a running forward
        assert (a.host.caught_up > 0) == b_paced  # late by a layer: caught up (instant: joined at layer 2)
    finally:
        await p.close()


def test_rows_joining_at_a_later_layer_match_rows_run_from_the_start(tiny_blocks) -> None:
    """`staggered` with `join`: the forward runs layer by layer and asks before each layer for rows that
    join there. Rows joining at layer 2 come out equal to the same rows present from the start, at the
    same cost (no knee: rows are free); rows joining past their first layer catch up alone first (same
    outputs up to float rounding, those layers charged)."""
    from kascade_engine.batch.model import LlamaModel

    m = LlamaModel(tiny_blocks.config)
    for blk in tiny_blocks.blocks.values():
        m.add_block(blk.id, blk.tensors())
    L, H = m.shape.layers, m.shape.hidden
    torch.manual_seed(0)
    xs = {"own": torch.randn(6, H, dtype=m.dtype), "late": torch.randn(3, H, dtype=m.dtype)}

    ref, ref_cost, _ = stagger(m, L, xs, None)
    out, cost, asked = stagger(m, L, xs, 2)
    assert asked == list(range(L + 1))  # before every layer, and once after the last
    assert cost == ref_cost == L
    for key in ref:
        assert torch.equal(out[key], ref[key]), key
    # a row joining past its first layer catches up alone first: the same outputs up to float rounding (its
    # layer 2 ran in a batch of its own: another matmul shape), its layers charged
    out2 = stagger(m, L, xs, 3)
    # the own rows too are equal only up to float rounding: from layer 3 on they share a matmul with the late
    # rows (9 rows, not 6), and whether a GEMM's result for a row depends on the other rows' count is the BLAS
    # build's choice (exact on one CI machine, last-bit differences on an AMD EPYC one)
    assert torch.allclose(out2[0]["own"], ref["own"], rtol=1e-5, atol=1e-4)
    assert torch.allclose(out2[0]["late"], ref["late"], rtol=1e-5, atol=1e-4)
    assert not torch.allclose(xs["late"], ref["late"], atol=1.0)  # (the rows did go through the layers)
    assert out2[1] == L + 1  # layer 2 for the late rows alone, then the rest shared


def stagger(m: Any, L: int, xs: dict[str, torch.Tensor],
            join_at: int | None) -> tuple[dict[str, torch.Tensor], float, list[int]]:
    """A staggered forward of an "own" row set (from layer 0) and a "late" one (from layer 2): both in the
    batch from the start (`join_at` None), or the late rows joining before layer `join_at`. Returns the
    rows' outputs, the forward's cost and the layers the join was asked about."""
    pool = Scheduler(Limits(kv_tokens=512, page_size=16)).pool
    cache = KVCache(L, 40, 16, m.shape.kv_heads, m.shape.head_dim, m.dtype, m.device)
    made = {}
    for key, n, a in (("own", 6, 0), ("late", 3, 2)):
        assert pool.grow(key, n)
        made[key] = Row(pool.tables[key], 0, n, a, L, xs[key].clone())
    asked: list[int] = []

    def join(u: int, cost: float) -> list[Row]:
        asked.append(u)
        return [made["late"]] if u == join_at else []

    rows = [made["own"], made["late"]] if join_at is None else [made["own"]]
    cost = staggered(m, cache, rows, 0, None if join_at is None else join)
    return {k: r.x for k, r in made.items()}, cost, asked


async def test_a_token_that_lands_during_bs_step_reaches_its_client_at_once(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17: A's answer to B's step i often comes back while B runs step i + 1's prefix (up to L - 1
    layer times). B lands it during that step and routes its tokens at once (PairClient.emit ->
    Serving.publish), instead of at the end of the step (bench: answers waited up to 540 ms there).
    Two prompts that do not fit one step together (whole prompts): the first goes out in B's first step,
    A (instant) answers it while B's second step — the second prompt's 0.6 s prefix — runs."""
    params = SamplingParams(max_tokens=3)
    first, second = list(range(1, 41)), list(range(50, 90))  # 40 tokens each, 64 per step
    want = unsplit(tiny_blocks, [first, second], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=3)
    try:
        b = p.b
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        assert b.pair is not None
        b.pair.layer_s = 0.2  # B's step: its 3-layer prefix, 0.6 s
        t0 = asyncio.get_running_loop().time()
        r1, r2 = b.serving.submit(first, params), b.serving.submit(second, params)
        q = b.serving.queues[r1]
        ev = await asyncio.wait_for(q.get(), 10)
        ttft = asyncio.get_running_loop().time() - t0
        q.put_nowait(ev)  # back where collect() reads it
        got = await asyncio.gather(collect(b, r1), collect(b, r2))
        assert got == want
        # B's first step (0.6 s), A's answer at once, then landed inside B's second step: ~0.6 s, not ~1.2 s
        assert ttft < 0.95, f"first token after {ttft:.2f} s"
    finally:
        await p.close()


def test_a_step_goes_out_as_one_frame_per_split_layer_highest_first(tiny_blocks) -> None:
    """Issue 17: A's forward takes a frame only if it has not passed the frame's lowest split layer (plus
    CATCH_UP_LAYERS), and answers go back in frame order. A step mixing a new prompt (the resident prefix,
    k = 3) with a decode row started earlier (k = 1) goes out as two frames, k = 3 first, so the prompt's
    frame can join A's running forward while the decode's waits for the next one (bench f3: the worst
    zigzag requests waited for such decode rows). The queue, ends and refusals ride in the last frame, and
    the depth counts B's steps, not frames."""
    from concurrent.futures import Future

    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.live.pairclient import PairClient

    m = LlamaModel(tiny_blocks.config)
    for bid in ("embed", "layer.0", "layer.1", "layer.2"):
        m.add_block(bid, tiny_blocks.blocks[bid].tensors())
    eng = Engine(m, Limits(max_batch_tokens=64, max_seqs=4, kv_tokens=256, page_size=16))
    pc = PairClient(m, None, None)  # type: ignore[arg-type]
    sent: list[tuple[list[list[Any]], int, list[str], dict[str, Any]]] = []

    def submit(meta: list[list[Any]], hidden: torch.Tensor, ends: list[str],
               extra: dict[str, Any] | None = None) -> Future[tuple[dict[str, Any], bytearray]]:
        sent.append((meta, int(hidden.shape[0]), ends, extra or {}))
        return Future()

    pc._submit = submit  # type: ignore[method-assign]
    old = eng.submit([1, 2, 3], SamplingParams(max_tokens=4), "old")
    assert [w.id for w in eng.scheduler.schedule().work] == [old]
    pc.split[old] = 1  # started when one layer was here; decoding now
    eng.scheduler.advance(old, 3, True)
    eng.requests[old].out.append(9)
    new = eng.submit([4, 5, 6, 7], SamplingParams(max_tokens=4), "new")
    work = eng.scheduler.schedule().work
    assert {(w.id, w.n) for w in work} == {(old, 1), (new, 4)}
    pc.forward(eng, work)
    assert [[r[0] for r in meta] for meta, _, _, _ in sent] == [[new], [old]]  # highest split layer first
    assert [meta[0][3] for meta, _, _, _ in sent] == [3, 1] and [n for _, n, _, _ in sent] == [4, 1]
    assert "waiting" not in sent[0][3] and "waiting" in sent[1][3]  # the step's queue in its last frame
    assert len(pc.inflight) == 2 and pc.max_inflight == 1  # two frames, one step out


def test_late_pair_steps_catch_up_within_one_budget_per_forward() -> None:
    """`take_late`: frames join a running forward in arrival order while the catch-up they need together
    (layers lowest..u-1, run once for all of them) fits what the forward may still add. The forward's
    budget is CATCH_UP_LAYERS in all: after a 2-layer catch-up, a frame 1 layer late waits for the next
    forward (before, each late frame could add its own catch-up: bench g2, A's own requests saw 1.8 s
    steps), while one at its layer still joins."""
    from collections import deque

    from kascade_engine.live.cooperation import CATCH_UP_LAYERS, PairStep, take_late

    def frame(*firsts: int) -> PairStep:
        return PairStep(0, [[f"r{i}", 0, 1, k, True, 0.0, 1.0, None] for i, k in enumerate(firsts)],
                        torch.zeros(len(firsts), 4), lambda _: None)

    assert CATCH_UP_LAYERS == 2
    inbox = deque([frame(3), frame(2, 5), frame(0), frame(4)])
    late, spent = take_late(inbox, 4, CATCH_UP_LAYERS)
    assert [len(st.rows) for st in late] == [1, 2] and spent == 2  # 3 and 2 join (2 layers, once); 0 is too far
    assert len(inbox) == 2  # the rest keeps its order: 0 blocks 4 behind it (answers go back in frame order)
    inbox = deque([frame(5), frame(6)])
    late, spent = take_late(inbox, 6, CATCH_UP_LAYERS - 2)  # the budget is spent: only a frame at its layer
    assert late == [] and spent == 0 and len(inbox) == 2
    inbox = deque([frame(6), frame(5)])
    late, spent = take_late(inbox, 6, 0)
    assert len(late) == 1 and spent == 0 and len(inbox) == 1
    assert take_late(deque([frame()]), 7, 0)[0]  # an empty frame (a poll) joins anywhere
