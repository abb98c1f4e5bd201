"""Continuous batching over paged KV: the pure scheduler's rules (decodes first, chunked prefill within
the token budget, admission by free pages, preemption, freeing), and the torch engine running them:
batched, chunked and preempted runs give exactly the tokens of one-at-a-time runs."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits, Scheduler, Seq

T = TypeVar("T")


def _run(s: Scheduler) -> list[tuple[str, int, int]]:
    """One step as the engine would do it: every chunk cached, a token sampled where a chunk ends."""
    b = s.schedule()
    for w in b.work:
        seq = s.running[w.id]
        s.advance(w.id, w.n, w.end == seq.total)
    return [(w.id, w.start, w.n) for w in b.work]


def test_a_sequence_added_at_the_front_is_admitted_first() -> None:
    """A request taken back from a live pair (redirect.py) has waited longest: it goes before the queue."""
    s = Scheduler(Limits(max_batch_tokens=4, max_seqs=4, kv_tokens=1000, page_size=4))
    s.add(Seq("a", 4, 3))
    s.add(Seq("b", 4, 3))
    s.add(Seq("back", 4, 3), front=True)
    assert [q.id for q in s.waiting] == ["back", "a", "b"]
    assert _run(s) == [("back", 0, 4)]


def test_decodes_first_then_chunked_prefill_within_budget() -> None:
    s = Scheduler(Limits(max_batch_tokens=10, max_seqs=4, kv_tokens=1000, page_size=4))
    s.add(Seq("a", 4, 3))
    s.add(Seq("b", 9, 3))
    assert _run(s) == [("a", 0, 4), ("b", 0, 6)]  # b's prompt is chunked: 6 now, 3 next step
    assert _run(s) == [("a", 4, 1), ("b", 6, 3)]  # a decodes first, b's prefill finishes
    s.add(Seq("c", 2, 3))
    assert _run(s) == [("a", 5, 1), ("b", 9, 1), ("c", 0, 2)]
    s.finish("a")
    assert [w[0] for w in _run(s)] == ["b", "c"]


def test_a_taken_back_decoder_finishes_its_accepted_prompts_under_the_budget() -> None:
    """The cap lifted (/convert null) while a prompt is half prefilled: that prompt and any already waiting
    finish under the budget they were accepted with; once no prompt is in prefill, the cap is gone."""
    s = Scheduler(Limits(max_batch_tokens=64, max_seqs=4, kv_tokens=1000, page_size=4, prefill_chunk_tokens=4))
    s.add(Seq("d", 1, 20))
    s.add(Seq("p", 12, 3))
    assert _run(s) == [("d", 0, 1), ("p", 0, 3)]
    assert _run(s) == [("d", 1, 1), ("p", 3, 4)]
    s.limits.prefill_chunk_tokens = None  # taken back
    s.add(Seq("q", 6, 3))
    assert _run(s) == [("d", 2, 1), ("p", 7, 4)] and s.last_cap == 4
    assert _run(s) == [("d", 3, 1), ("p", 11, 1), ("q", 0, 4)]  # p's last prompt token samples like a decode
    assert _run(s) == [("d", 4, 1), ("p", 12, 1), ("q", 4, 2)] and s.last_cap == 4
    assert _run(s) == [("d", 5, 1), ("p", 13, 1), ("q", 6, 1)] and s.last_cap is None  # no prompt left
    s.add(Seq("r", 30, 3))
    assert _run(s)[-1] == ("r", 0, 30)  # uncapped now


def test_a_step_is_saturated_when_its_token_budget_ran_out_while_prompt_tokens_waited() -> None:
    """`last_saturated` (the steps whose tokens/s is the engine's prefill capacity, velocity.py): the token budget,
    the chunk cap or the time budget ran out while prompt tokens waited. A prompt alone, a budget filled exactly
    with nothing behind it, a step held back by seats or pages: not saturated."""
    s = Scheduler(Limits(max_batch_tokens=10, max_seqs=4, kv_tokens=1000, page_size=4))
    s.add(Seq("a", 4, 3))
    assert _run(s) == [("a", 0, 4)] and not s.last_saturated  # alone, the budget not reached
    s.add(Seq("b", 20, 3))
    assert _run(s) == [("a", 4, 1), ("b", 0, 9)] and s.last_saturated  # b chunked: 11 of its tokens wait
    assert _run(s) == [("a", 5, 1), ("b", 9, 9)] and s.last_saturated
    assert _run(s) == [("a", 6, 1), ("b", 18, 2)] and not s.last_saturated  # b's last chunk, nothing behind
    s.add(Seq("c", 8, 3))
    s.add(Seq("d", 8, 3))
    assert _run(s) == [("a", 7, 1), ("b", 20, 1), ("c", 0, 8)] and s.last_saturated  # budget out, d queued
    s2 = Scheduler(Limits(max_batch_tokens=10, max_seqs=4, kv_tokens=1000, page_size=4))
    s2.add(Seq("x", 5, 3))
    s2.add(Seq("y", 5, 3))
    assert _run(s2) == [("x", 0, 5), ("y", 0, 5)] and not s2.last_saturated  # full, but nothing waits
    seats = Scheduler(Limits(max_batch_tokens=100, max_seqs=1, kv_tokens=1000, page_size=4))
    seats.add(Seq("x", 5, 3))
    seats.add(Seq("y", 5, 3))
    assert _run(seats) == [("x", 0, 5)] and not seats.last_saturated  # y waits for a seat, not for tokens
    capped = Scheduler(Limits(max_batch_tokens=100, max_seqs=4, kv_tokens=1000, page_size=4, prefill_chunk_tokens=6))
    capped.add(Seq("p", 20, 3))
    assert _run(capped) == [("p", 0, 6)] and capped.last_saturated  # a converted decoder's chunk cap


def test_admission_by_free_pages_and_finish_frees_them() -> None:
    s = Scheduler(Limits(max_batch_tokens=100, max_seqs=8, kv_tokens=16, page_size=4))  # 4 pages
    s.add(Seq("a", 8, 4))
    s.add(Seq("b", 9, 4))  # needs 3 pages, 2 are free after a: waits (FCFS)
    s.add(Seq("c", 1, 1))
    assert [w[0] for w in _run(s)] == ["a"] and s.pool.free_pages == 2
    assert [w[0] for w in _run(s)] == ["a"]
    s.finish("a")
    assert s.pool.free_pages == 4
    assert [w[0] for w in _run(s)] == ["b", "c"]


def test_preemption_when_pages_run_out() -> None:
    s = Scheduler(Limits(max_batch_tokens=100, max_seqs=8, kv_tokens=8, page_size=2))  # 4 pages
    s.add(Seq("old", 4, 4))
    s.add(Seq("new", 4, 4))
    assert _run(s) == [("old", 0, 4), ("new", 0, 4)] and s.pool.free_pages == 0
    assert _run(s) == [("old", 4, 1)]  # position 4 needs a third page: new is preempted, its pages go to old
    assert s.preemptions == 1 and [q.id for q in s.waiting] == ["new"]
    assert s.waiting[0].computed == 0 and s.waiting[0].total == 5  # recomputed with its generated token


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="KV capacity of 96 tokens"):
        Scheduler(Limits(kv_tokens=96, page_size=16)).add(Seq("big", 90, 20))
    with pytest.raises(ValueError, match="max_seqs"):
        Limits(max_seqs=0)


def _model(blocks) -> LlamaModel:
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return m


PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7], [300, 200, 100, 5, 6]]


def test_batched_chunked_and_preempted_equal_one_at_a_time(tiny_blocks) -> None:
    m = _model(tiny_blocks)
    params = SamplingParams(max_tokens=12)
    alone = [Engine(m, Limits(kv_tokens=256)).generate(p, params) for p in PROMPTS]
    assert len({tuple(a) for a in alone}) == len(PROMPTS)
    batched = Engine(m, Limits(max_batch_tokens=64, kv_tokens=256))
    assert batched.generate_many(PROMPTS, params) == alone
    chunked = Engine(m, Limits(max_batch_tokens=4, kv_tokens=256, page_size=2))  # prompts take several steps
    assert chunked.generate_many(PROMPTS, params) == alone
    tight = Engine(m, Limits(max_batch_tokens=64, kv_tokens=40, page_size=4))  # 10 pages for 4 x ~20 tokens
    assert tight.generate_many(PROMPTS, params) == alone
    assert tight.scheduler.preemptions > 0
    assert tight.scheduler.pool.used_pages == 0 and tight.scheduler.idle


def test_greedy_batch_equals_transformers(tiny_ckpt, tiny_blocks) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got = Engine(_model(tiny_blocks), Limits(max_batch_tokens=8, kv_tokens=256, page_size=4)).generate_many(
        PROMPTS, SamplingParams(max_tokens=10))
    assert got == want


def test_abort_frees_pages_and_failure_is_isolated(tiny_blocks) -> None:
    m = _model(tiny_blocks)
    eng = Engine(m, Limits(max_batch_tokens=64, max_seqs=4, kv_tokens=256, page_size=4))
    good = eng.submit([1, 2, 3], SamplingParams(max_tokens=3))
    gone = eng.submit([4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=30))
    eng.step()
    assert eng.scheduler.pool.tables[gone] and eng.scheduler.pool.used_pages == 3
    eng.abort(gone)
    events = eng.step()
    assert [e.request for e in events] == [good] and gone not in eng.scheduler.pool.tables
    assert eng.scheduler.pool.used_pages == 1
    del m.weights["layer.2"]
    events = eng.step()
    assert events[0].token == -1 and "layer.2 is not resident" in (events[0].reason or "")
    assert eng.scheduler.idle and not eng.requests and eng.scheduler.pool.used_pages == 0


def test_no_tensor_lands_on_a_default_device(tiny_blocks) -> None:
    """Every allocation in the engine names its device: with the default device set to `meta`, a step
    still computes real tokens (a tensor made without a device would be a meta tensor and fail)."""
    m = _model(tiny_blocks)
    want = Engine(m, Limits(kv_tokens=256)).generate_many(PROMPTS[:2], SamplingParams(max_tokens=4))
    torch.set_default_device("meta")
    try:
        eng = Engine(m, Limits(kv_tokens=256, max_batch_tokens=4))
        got = eng.generate_many(PROMPTS[:2], SamplingParams(max_tokens=4))
        assert eng.cache.k.device.type == "cpu"
    finally:
        torch.set_default_device(None)
    assert got == want


def test_prefill_chunks_of_a_step_share_one_attention_call(tiny_blocks) -> None:
    """Prefill chunks of different lengths and starts (plus decodes) run as two attention groups per layer,
    and every token's hidden state equals the one its sequence computes alone."""
    from kascade_engine.batch.kvcache import KVCache, build_batch

    m = _model(tiny_blocks)
    s = m.shape

    def cache() -> KVCache:
        return KVCache(s.layers, 32, 4, s.kv_heads, s.head_dim, m.dtype, m.device)

    def run(c: KVCache, chunks: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, int]:
        batch = build_batch(c, [(table, start, len(ids)) for table, start, ids in chunks])
        ids = torch.tensor([t for _, _, toks in chunks for t in toks], dtype=torch.long)
        return m.run_layers(0, s.layers, m.embed(ids), batch), len(batch.groups) + (batch.decode is not None)

    toks = {"a": list(range(10, 21)), "b": [5, 6, 7, 8, 9], "c": [300, 301, 302], "d": [7, 8]}
    tables = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8], "d": [9, 10]}  # 4 slots per page
    # step 1: d's whole prompt, a's first chunk, b and c whole; step 2: d and b decode, a's second chunk
    steps = [[("d", 0, 2), ("a", 0, 6), ("b", 0, 5), ("c", 0, 3)], [("d", 2, 1), ("b", 5, 1), ("a", 6, 5)]]
    toks["d"].append(11)
    toks["b"].append(12)
    shared = cache()
    alone = {k: cache() for k in toks}
    for step in steps:
        chunks = [(tables[k], start, toks[k][start:start + n]) for k, start, n in step]
        got, groups = run(shared, chunks)
        assert groups == len({n == 1 for _, _, n in step})  # decodes in one call, prefills in one
        row = 0
        for (k, start, n), (table, _, ids) in zip(step, chunks, strict=True):
            want, _ = run(alone[k], [(table, start, ids)])
            torch.testing.assert_close(got[row:row + n], want, rtol=1e-4, atol=1e-4)  # GEMM rounding
            row += n


def test_a_converted_decoders_step_budget_cuts_its_chunks_to_the_time_its_decodes_leave() -> None:
    """Token cap 64 with a 20 ms step budget on an engine whose measured cost is 6 ms + 0.1 ms/decode + 0.8
    ms/prompt token + 4 ms per 1000 gathered keys: beside 4 decodes at ~100 keys a step has room for about
    16 prompt tokens, beside 8 for fewer; with no decode in the step the token cap alone applies, and so it
    does before a prompt token was ever timed."""
    from kascade_engine.batch.stepcost import StepCost, StepShape

    def true_s(shape: StepShape) -> float:
        return 6e-3 + 1e-4 * shape.decodes + 8e-4 * shape.prompt_tokens + 4e-3 * shape.features()[3]

    def largest_fit(work: list[tuple[str, int, int]], rid: str) -> int:
        """The largest chunk of `rid` that this step's true cost keeps within 20 ms."""
        start, n = next((w[1], w[2]) for w in work if w[0] == rid)
        rest = [(w[1], w[2]) for w in work if w[0] != rid]
        base = StepShape.of(rest)
        return max(m for m in range(n + 64) if m == 0 or true_s(base.with_chunk(start, m)) <= 0.02)

    cost = StepCost()
    s = Scheduler(Limits(max_batch_tokens=512, max_seqs=16, kv_tokens=4000, page_size=4, prefill_chunk_tokens=64,
                         step_budget_s=0.02), cost=cost)
    s.add(Seq("p0", 200, 2))  # no decode yet: 64 tokens (the cap), whatever the time
    assert _run(s) == [("p0", 0, 64)]
    for i in range(4):
        s.add(Seq(f"d{i}", 98, 50))
    s.finish("p0")
    while any(q.total - q.computed > 1 for q in s.running.values()) or s.waiting:
        _run(s)  # the decoders' prompts, cost unknown: under the cap alone
    for i in range(200):  # the engine's steps, as Engine.step feeds them
        shape = StepShape(1 + i % 8, 50 + i % 300)
        cost.observe(shape.with_chunk(i % 100, 2 + i % 30) if i % 3 else shape, true_s(shape.with_chunk(
            i % 100, 2 + i % 30) if i % 3 else shape))
    s.add(Seq("p", 200, 2))
    work = _run(s)
    assert [w[2] for w in work if w[0].startswith("d")] == [1, 1, 1, 1]  # decodes are never cut
    (chunk,) = [w for w in work if w[0] == "p"]
    assert 12 <= chunk[2] == largest_fit(work, "p") < 64
    assert s.cut_tokens == 64 - chunk[2] and s.last_budget_s == 0.02
    first = chunk[2]
    s.finish("p")
    for i in range(4, 8):
        s.add(Seq(f"d{i}", 98, 50))
    while any(q.total - q.computed > 1 for q in s.running.values()) or s.waiting:
        _run(s)  # their prompts, now cut to the time the first four's decodes leave
    s.add(Seq("q", 200, 2))
    work = _run(s)
    (chunk,) = [w for w in work if w[0] == "q"]
    assert 0 < chunk[2] == largest_fit(work, "q") < first  # twice the decodes: less room
    s.limits.prefill_chunk_tokens = s.limits.step_budget_s = None  # taken back: q keeps both budgets
    work = _run(s)
    assert [w[2] for w in work if w[0] == "q"] == [largest_fit(work, "q")] and s.last_budget_s == 0.02


def test_a_converted_decoder_reports_the_prefill_room_its_step_budget_leaves() -> None:
    """prefill_room: None unconverted; the token cap with no decode or no measured cost; beside decodes that
    fill the step budget, 0 (what `schedule` would give a chunk)."""
    from kascade_engine.batch.stepcost import StepCost, StepShape

    cost = StepCost()
    s = Scheduler(Limits(max_batch_tokens=512, max_seqs=16, kv_tokens=4000, page_size=4), cost=cost)
    assert s.prefill_room() is None
    s.limits.prefill_chunk_tokens, s.limits.step_budget_s = 32, 0.02
    assert s.prefill_room() == 32
    for i in range(8):
        s.add(Seq(f"d{i}", 8, 50))
    while any(q.total - q.computed > 1 for q in s.running.values()) or s.waiting:
        _run(s)
    assert s.prefill_room() == 32  # prompt-token cost not timed yet
    for _ in range(50):  # 1 ms/decode, 1 ms/prompt token: 8 decodes + 1 ms base leave 11 ms -> 11 tokens
        for shape in (StepShape(8, 20), StepShape(8, 20, 10, 1, 10), StepShape(2, 20, 5, 1, 5)):
            cost.observe(shape, 1e-3 + 1e-3 * shape.decodes + 1e-3 * shape.prompt_tokens)
    assert 9 <= (s.prefill_room() or 0) <= 11
    # 4 prompts a prefill engine prefills for it now join as decodes when their KV lands: 4 ms less room (the
    # schedule of this step is unchanged: they are not in it)
    for i in range(4):
        s.expect(f"j{i}", 12)
    assert 5 <= (s.prefill_room() or 0) <= 7 and s.decodes() == 8 + 4
    for i in range(4):
        s.landed(f"j{i}")
    s.limits.step_budget_s = 0.005  # the decodes alone fill it
    assert s.prefill_room() == 0


def test_waiting_prompts_queue_by_arrival_so_a_handed_back_prompt_goes_ahead_of_later_ones() -> None:
    """A prefill engine queues a prompt a converted decoder hands back by the time it first arrived
    (kv_wire.PrefillOp.waited_s -> Seq.arrived), not behind prompts that arrived after it; equal arrivals and
    prompts without one keep FCFS, and `front` still goes first."""
    s = Scheduler(Limits(kv_tokens=4096))
    for i, t in enumerate((1.0, 2.0, 3.0)):
        s.add(Seq(f"r{i}", 10, 4, arrived=t))
    s.add(Seq("back", 10, 4, arrived=1.5))  # arrived at 1.5 on its decoder, handed back after r2 arrived
    s.add(Seq("late", 10, 4, arrived=3.0))  # same arrival as r2: after it
    assert [q.id for q in s.waiting] == ["r0", "back", "r1", "r2", "late"]
    s.add(Seq("pre", 10, 4, arrived=9.0), front=True)
    assert s.waiting[0].id == "pre"
    plain = Scheduler(Limits(kv_tokens=4096))
    for i in range(3):
        plain.add(Seq(f"p{i}", 10, 4))
    assert [q.id for q in plain.waiting] == ["p0", "p1", "p2"]


def test_the_event_loop_queueing_while_the_step_thread_finishes_loses_nothing() -> None:
    """`Engine.submit` queues from the event loop while the step thread finishes sequences (done, aborted, handed
    to a live pair). A `finish` that rebuilt the queue from an iteration over it lost requests queued meanwhile
    (they were never scheduled: the client waited out its timeout) or failed the whole step with "deque mutated
    during iteration" (every request on the engine answered 500); measured with this test's threads: 272 of
    4,000 requests lost, 170 failed finishes. Queued sequences finished here go; every other one stays, in order."""
    sched = Scheduler()
    queued_first = [f"x{j}" for j in range(300)]
    for rid in queued_first:
        sched.add(Seq(rid, 4, 4))
    errors: list[BaseException] = []
    done = threading.Event()

    def step_thread() -> None:
        k = 0
        while not done.is_set():
            try:
                sched.finish(queued_first[k] if k < len(queued_first) else f"gone-{k}")  # then: never queued
            except RuntimeError as e:
                errors.append(e)
            k += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race in every run
    t = threading.Thread(target=step_thread)
    t.start()
    try:
        for i in range(3000):
            sched.add(Seq(f"r{i}", 4, 4, arrived=float(i)))
    finally:
        done.set()
        t.join()
        sys.setswitchinterval(old)
    assert errors == []
    left = [s.id for s in sched.waiting]
    assert [r for r in left if r.startswith("x")] == []
    assert left == [f"r{i}" for i in range(3000)]


class _Finalized:
    """Cyclic garbage whose finalizer lets other threads run, as a socket or a transport's may: the cyclic GC
    frees it at some allocation, such as a tuple's."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def _read_while_changed(change: Callable[[int], None], read: Callable[[], T], times: int = 20000) -> list[T]:
    """`read()` `times` times, each after making cyclic garbage with a GIL-releasing finalizer, while another
    thread calls `change(0)`, `change(1)`, ... all along; what a read raised fails the test."""
    done = threading.Event()

    def other_thread() -> None:
        for k in itertools.count():
            if done.is_set():
                return
            change(k)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        out = []
        for _ in range(times):
            _Finalized()
            out.append(read())
        return out
    finally:
        done.set()
        t.join()


def test_a_snapshot_of_the_queue_is_whole_while_the_step_thread_changes_it() -> None:
    """`tuple(waiting)` is one C call, yet not atomic: allocating the tuple may run the cyclic GC, a finalizer may
    let the step thread run, and the copy raises "deque mutated during iteration". In a request's handler
    (Serving.shed_check) that was an HTTP 500 with no JSON body; copied without the lock here: 29 of 20,000 raised."""
    sched = Scheduler()
    for i in range(50):
        sched.add(Seq(f"q{i}", 4, 4))

    def step_thread(k: int) -> None:
        sched.add(Seq(f"n{k}", 4, 4))
        sched.finish(f"n{k}")

    for snap in _read_while_changed(step_thread, sched.queued):
        assert [s.id for s in snap[:50]] == [f"q{i}" for i in range(50)]


def test_the_joining_prompts_are_copied_whole_while_the_event_loop_changes_them() -> None:
    """The recorder reads `prefill_room` in the step thread while remote prefills start and land on the event loop.
    `tuple(joining.values())` without the lock raised "dictionary changed size during iteration" 25 times in
    20,000 here (a failed step: every request on the engine gets an error)."""
    sched = Scheduler(Limits(max_batch_tokens=64, max_seqs=8, kv_tokens=512, page_size=16, prefill_chunk_tokens=32))
    for i in range(50):
        sched.expect(f"j{i}", 12)

    def event_loop(k: int) -> None:
        sched.expect(f"n{k}", 4)
        if k % 1000 == 999:  # a size that keeps changing: a copy the other thread interrupts sees it
            for j in range(k - 999, k + 1):
                sched.landed(f"n{j}")

    assert set(_read_while_changed(event_loop, sched.prefill_room)) == {32}  # the cap: no step budget cuts it
