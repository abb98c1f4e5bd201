"""A converted decoder D hands a prompt it prefills itself to the prefill engine P the router named
(kascade_engine.handback): without prefill progress for its hand-back bound, or progressing slower than the
remote path would finish it. P queues the prompt at its arrival on D (kv_wire.PrefillOp.waited_s); greedy
output equals the colocated engine's. In-process P and D (pdpair.py); the same through the router on real
engine processes is tests/router/test_router_handback.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from pdpair import PROMPTS, pd_pair  # type: ignore[import-not-found]
from splitref import collect, unsplit  # type: ignore[import-not-found]

from kascade_engine.kv_wire import KVShape, KVWireError, PrefillOp, waited_s
from kascade_engine.sampling import SamplingParams


class _NoRoom:
    """A converted decoder's step-cost model beside a big batch: its decodes alone fill the step budget, so a
    prompt chunk gets 0 tokens in every step that decodes (StepCost.chunk_fits' answer there)."""

    token_s = 1e-3

    def chunk_fits(self, budget_s: float, shape: Any, start: int, n: int) -> int:
        return 0


async def test_a_converted_decoder_hands_a_prompt_without_room_to_the_prefill_engine(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """D, converted, decodes four long streams.
    - A prompt D is sent to prefill itself, with the router's fallback prefill engine P (PREFILL_FALLBACK_HEADER),
      right after the conversion: D has not measured its prefill rate yet (its warm-up probe runs), so it cannot
      predict finishing it and hands it to P at once (on arrival), without holding it for the bound.
    - Once the probe measured the rate (and the remote path looks slower than any local pace), D takes the next
      one; then its step budget leaves the prompt 0 tokens beside the streams: after the hand-back bound with no
      progress and no token out, D takes it out of its batch and P prefills it, queued at its arrival on D.
    Greedy output equals the colocated engine's, and both are done while the streams still run. Without the
    hand-back the second waits on D (0 tokens a step) until the streams end. A prompt that has room (no decodes
    beside it) is not handed back, nor one whose engine is not converted."""
    from kascade_planner.engine_api import ConvertRequest

    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    long = SamplingParams(max_tokens=480)  # the tiny model's 512 positions hold it after a short prompt
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    d = pd.d
    try:
        # not converted: the fallback is only a name, the prompt prefills here
        assert await collect(d, d.serving.submit(PROMPTS[0], params, fallback=pd.peer)) == want[0]
        streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
        ends: dict[str, float] = {}

        async def drain(rid: str) -> None:
            async for ev in d.serving.tokens(rid):
                if ev.finished:
                    ends[rid] = time.monotonic()

        tasks = [asyncio.create_task(drain(r)) for r in streams]
        while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        arrivals: list[float | None] = []  # when P queues a handed-back prompt (its Seq.arrived)
        p_submit = pd.p.engine.submit

        def spy(*a: Any, **kw: Any) -> str:
            arrivals.append(kw.get("arrived"))
            return p_submit(*a, **kw)

        pd.p.engine.submit = spy  # type: ignore[method-assign]
        # a step budget of 1 s: the probe's chunks fit it beside the streams, so the rate it measures is > 0
        st = d.convert(ConvertRequest(16, 1000.0, hand_back_ms=100.0)).extra
        assert st["handBackMs"] == 100.0
        assert d.probe.rid is not None and d.engine.meter.prefill_rate() is None
        got = await asyncio.wait_for(collect(d, d.serving.submit(PROMPTS[0], params, fallback=pd.peer)), 60)
        assert got == want[0]
        assert d.handback.handed == d.handback.at_arrival == 1 and pd.p.prefill_server.requests == 1
        assert d.remote_prefill.adopted == 1 and len(arrivals) == 1
        while d.probe.rid is not None:
            await asyncio.sleep(0.005)
        assert d.probe.ended[-1][0] == "measured" and (d.engine.meter.prefill_rate() or 0) > 0
        assert not any(r.startswith("probe-") for r in d.engine.requests), "the probe left the scheduler"
        d.remote_prefill.took[pd.peer] = 1e6  # the remote path slower than any local pace: D takes the next one
        d.engine.scheduler.cost = _NoRoom()  # type: ignore[assignment]
        t0 = time.monotonic()
        rid = d.serving.submit(PROMPTS[0], params, fallback=pd.peer)
        got = await asyncio.wait_for(collect(d, rid), 60)
        t_done = time.monotonic()
        assert got == want[0]
        # P queued it by its arrival at D (one monotonic clock in this process), not at the hand-back >= 0.1 s later
        assert len(arrivals) == 2 and arrivals[1] is not None and abs(arrivals[1] - t0) < 0.05, (arrivals, t0)
        assert not ends, "the streams ended before the handed-back prompts: nothing was stranded"
        assert t_done - t0 >= 0.1  # held for the bound first
        assert d.handback.handed == 2 and d.handback.at_arrival == 1 and pd.p.prefill_server.requests == 2
        assert d.remote_prefill.adopted == 2 and d.remote_prefill.fallbacks == 0
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        # room again (no decodes beside it: the token cap alone): prefilled here, not handed back
        assert await collect(d, d.serving.submit(PROMPTS[1], params, fallback=pd.peer)) == want[1]
        assert d.handback.handed == 2 and pd.p.prefill_server.requests == 2
        assert d.convert(ConvertRequest(None)).extra.get("handBackMs") is None
    finally:
        await pd.close()
    assert ConvertRequest.from_dict({"prefillChunkTokens": 8, "handBackMs": 250}) == ConvertRequest(8, None, 250.0)
    for bad in (0, -1, True, "1", float("inf")):
        with pytest.raises(Exception) as e:
            ConvertRequest.from_dict({"prefillChunkTokens": 8, "handBackMs": bad})
        assert "handBackMs" in str(e.value)


class _SlowRoom:
    """A converted decoder's step-cost model that gives a prompt one token per `every_s` of steps that decode:
    a prompt progresses in every hand-back bound, slowly (time-based, so the pace does not depend on how fast
    this machine runs a step)."""

    token_s = 1e-3

    def __init__(self, every_s: float) -> None:
        self.every_s, self.last = every_s, 0.0

    def chunk_fits(self, budget_s: float, shape: Any, start: int, n: int) -> int:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return 0
        self.last = now
        return min(n, 1)


async def test_a_converted_decoder_hands_back_a_prompt_that_progresses_slower_than_the_remote_path(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """The production rule: a prompt that progresses, but at a pace whose predicted finish here (tokens left /
    the rate over the last bound) is later than what a remote prefill on P took lately (measured on real
    remote prefills), is handed back; the same pace with a slower remote path stays. Without the rule (no
    progress only) the slow prompt is never handed back."""
    from kascade_planner.engine_api import ConvertRequest

    params = SamplingParams(max_tokens=8)
    prompt = list(range(40, 77))  # 37 tokens
    want = unsplit(tiny_blocks, [prompt], params)
    long = SamplingParams(max_tokens=480)
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    d = pd.d
    try:
        # the remote path, measured: two prompts prefilled on P for D
        for q in PROMPTS[:2]:
            await collect(d, d.serving.submit(q, params, prefill=pd.peer))
        took = d.remote_prefill.took[pd.peer]
        assert 0 < took < 5
        streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
        tasks = [asyncio.create_task(collect(d, r)) for r in streams]
        while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        d.convert(ConvertRequest(16, 30.0, hand_back_ms=100.0))
        d.engine.scheduler.cost = _SlowRoom(0.02)  # type: ignore[assignment]  # ~50 tok/s: 37 tokens ~0.7 s
        while d.probe.rid is not None:  # the warm-up probe measures the rate first (a prompt before it goes to P)
            await asyncio.sleep(0.005)
        assert (d.engine.meter.prefill_rate() or 0) > 0
        # on arrival the measured rate is compared with a remote path that looks slower: D takes the prompt; the
        # hand-back check after the bound then sees the real remote path and the pace the prompt got
        d.remote_prefill.took[pd.peer] = 1e6
        rid = d.serving.submit(prompt, params, fallback=pd.peer)
        d.remote_prefill.took[pd.peer] = took
        assert await asyncio.wait_for(collect(d, rid), 60) == want[0]
        assert d.handback.handed == 1 and d.handback.at_arrival == 0 and d.remote_prefill.fallbacks == 0
        assert not all(t.done() for t in tasks)
        # a remote path slower than any local pace: the same slow prompt stays and finishes here
        d.remote_prefill.took[pd.peer] = 1e6
        served = pd.p.prefill_server.requests
        rid = d.serving.submit(prompt, params, fallback=pd.peer)
        assert await asyncio.wait_for(collect(d, rid), 120) == want[0]
        assert d.handback.handed == 1 and pd.p.prefill_server.requests == served
        for t in tasks:  # the clients leave (their work, keeping D busy, is done): that aborts the streams
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await pd.close()


def test_the_hand_back_verdict() -> None:
    from kascade_planner.conversion import hand_back_verdict as verdict

    assert verdict(100, 0, 0.25, None) is not None  # no progress: always
    assert verdict(100, 0, 0.25, 10.0) is not None
    assert verdict(100, 10, 0.25, None) is None  # progress, remote path unmeasured: stays
    assert verdict(100, 10, 0.25, 1.0) is not None  # 2.5 s left here against 1 s there
    assert verdict(100, 10, 0.25, 3.0) is None
    assert verdict(0, 10, 0.25, 0.001) is None  # done here


def test_the_prefill_op_carries_the_time_a_prompt_waited() -> None:
    shape = KVShape(2, 1, 4, "float32", 4)
    h = PrefillOp("r", [1, 2], 0.0, 1.0, None, shape, 1.25).to_header()
    assert h["op"] == "prefill" and waited_s(h) == 1.25 and shape.mismatch(h) is None
    assert "waited_s" not in PrefillOp("r", [1], 0.0, 1.0, 7, shape).to_header()
    assert waited_s({}) == 0.0
    for bad in (-1, True, "1", float("inf"), float("nan")):
        with pytest.raises(KVWireError, match="waited_s"):
            waited_s({"waited_s": bad})


def test_the_remote_path_estimate_follows_a_growing_queue() -> None:
    """What the hand-back compares with: the moving average of landed remote prefills, or the age of one still
    in flight when that is longer (a burst's queue at the prefill engine grows before any of it lands)."""
    from types import SimpleNamespace

    from kascade_engine.remote_prefill import RemotePrefill

    rp = RemotePrefill(SimpleNamespace(transport=None, config=SimpleNamespace(token="t")))  # type: ignore[arg-type]
    assert rp.expected_s("p:1") is None
    rp.took["p:1"] = 0.3
    assert rp.expected_s("p:1") == 0.3
    rp.pending["r1"] = ("p:1", time.monotonic() - 1.5)  # sent 1.5 s ago, not landed
    rp.pending["r2"] = ("q:2", time.monotonic() - 9.0)  # another peer's queue says nothing of p:1
    assert 1.5 <= rp.expected_s("p:1") < 2.5  # type: ignore[operator]
    del rp.took["p:1"]
    assert 1.5 <= rp.expected_s("p:1") < 2.5  # type: ignore[operator]
