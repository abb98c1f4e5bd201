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
