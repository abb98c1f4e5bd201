"""Continuous batching rules (pure python, no torch)."""

from __future__ import annotations

import pytest

from kascade_engine.scheduler import Limits, Scheduler, Seq


def test_decode_first_then_fcfs_prefill_within_token_budget() -> None:
    s = Scheduler(Limits(max_batch_tokens=10, max_seqs=4, kv_tokens=1000))
    for i, n in enumerate([4, 5, 2]):
        s.add(Seq(f"r{i}", n, 3))
    b1 = s.schedule()
    assert b1.prefill == ("r0", "r1") and b1.decode == ()  # 4+5 fit, 2 more would exceed 10
    b2 = s.schedule()
    assert b2.decode == ("r0", "r1") and b2.prefill == ("r2",)
    s.finish("r0")
    assert s.schedule().decode == ("r1", "r2")


def test_head_of_line_blocks_and_kv_budget() -> None:
    s = Scheduler(Limits(max_batch_tokens=100, max_seqs=8, kv_tokens=20))
    s.add(Seq("a", 8, 4))
    s.add(Seq("b", 8, 4))  # 12 + 12 > 20: must wait for a
    assert s.schedule().prefill == ("a",)
    assert s.schedule().prefill == ()
    s.finish("a")
    assert s.schedule().prefill == ("b",)
    assert not s.idle
    s.finish("b")
    assert s.idle


def test_max_seqs_and_bad_inputs() -> None:
    s = Scheduler(Limits(max_batch_tokens=100, max_seqs=2, kv_tokens=100))
    for i in range(3):
        s.add(Seq(f"r{i}", 1, 1))
    assert len(s.schedule().prefill) == 2
    with pytest.raises(ValueError, match="KV capacity"):
        s.add(Seq("big", 90, 20))
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Scheduler(Limits(max_batch_tokens=5, kv_tokens=100)).add(Seq("x", 6, 1))
    with pytest.raises(ValueError, match="max_seqs"):
        Limits(max_seqs=0)


def test_engine_abort_and_failure_isolated(tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """A failing request (here: a missing block) fails alone; an aborted one frees its slot."""
    from kascade_engine.engine import Engine
    from kascade_engine.model import LlamaModel
    from kascade_engine.sampling import SamplingParams

    m = LlamaModel(tiny_blocks.config)
    for b in tiny_blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    eng = Engine(m, Limits(max_batch_tokens=64, max_seqs=4, kv_tokens=256))
    good = eng.submit([1, 2, 3], SamplingParams(max_tokens=3))
    gone = eng.submit([4, 5], SamplingParams(max_tokens=3))
    eng.abort(gone)
    events = eng.step()
    assert [e.request for e in events] == [good]
    del m.weights["layer.2"]
    events = eng.step()
    assert events[0].token == -1 and "layer.2 is not resident" in (events[0].reason or "")
    assert eng.scheduler.idle and not eng.requests
