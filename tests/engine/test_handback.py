"""A converted decoder D hands a prompt it prefills itself to the prefill engine P the router named
(kascade_engine.pd.handback): without prefill progress for its hand-back bound, or progressing slower than the
remote path would finish it. P queues the prompt at its arrival on D (kv_wire.PrefillOp.waited_s); greedy
output equals the colocated engine's. In-process P and D (pdpair.py); the same through the router on real
engine processes is tests/router/test_router_handback.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from pdpair import PROMPTS, pd_pair
from splitref import collect, unsplit

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.pd.kv_wire import KVShape, KVWireError, PrefillOp, fallback, waited_s


class _NoRoom:
    """A converted decoder's step-cost model beside a big batch: its decodes alone fill the step budget, so a
    prompt chunk gets 0 tokens in every step that decodes (StepCost.chunk_fits' answer there)."""

    token_s = 1e-3

    def chunk_fits(self, budget_s: float, shape: Any, start: int, n: int) -> int:
        return 0


async def test_a_converted_decoder_hands_a_prompt_without_room_to_the_prefill_engine(tiny_ckpt, tiny_blocks) -> None:
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

        pd.p.engine.submit = spy
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
        d.engine.scheduler.cost = _NoRoom()
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


async def test_a_converted_decoder_hands_back_a_prompt_that_progresses_slower_than_the_remote_path(
    tiny_ckpt, tiny_blocks
) -> None:
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
        d.engine.scheduler.cost = _SlowRoom(0.02)  # ~50 tok/s: 37 tokens ~0.7 s
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


def test_the_arrival_verdict() -> None:
    """The hand-back rule on arrival: the measured rate in place of progress not seen yet."""
    from kascade_planner.conversion import arrival_verdict as verdict

    assert verdict(100, None, None, 4) is not None  # not measured: it cannot predict a finish, whatever P is
    assert verdict(100, None, 10.0, 4) is not None
    assert verdict(100, 0.0, None, 4) is not None  # measured 0: no progress to expect
    assert verdict(100, 40.0, None, 4) is None  # a pace, remote path unmeasured: it starts it
    assert verdict(100, 40.0, 1.0, 4) is not None  # 2.5 s here against 1 s there
    assert verdict(100, 40.0, 3.0, 4) is None
    assert verdict(100, None, 1.0, 0) is verdict(100, 0.0, 1.0, 0) is None  # no decodes: the whole cap, any rate
    for bad in ((0, 1.0, None, 1), (1, -1.0, None, 1), (1, float("nan"), None, 1), (1, 1.0, None, -1)):
        with pytest.raises(ValueError):
            verdict(*bad)


def test_the_prefill_op_carries_the_time_a_prompt_waited() -> None:
    shape = KVShape(2, 1, 4, "float32", 4)
    h = PrefillOp("r", [1, 2], 0.0, 1.0, None, shape, 1.25).to_header()
    assert h["op"] == "prefill" and waited_s(h) == 1.25 and shape.mismatch(h) is None
    assert "waited_s" not in PrefillOp("r", [1], 0.0, 1.0, 7, shape).to_header()
    assert waited_s({}) == 0.0
    for bad in (-1, True, "1", float("inf"), float("nan")):
        with pytest.raises(KVWireError, match="waited_s"):
            waited_s({"waited_s": bad})
    # and the prefill engine the decode engine goes to if this one (a converted decoder) hands the prompt back
    h = PrefillOp("r", [1], 0.0, 1.0, None, shape, 0.0, "10.0.0.1:7000").to_header()
    assert fallback(h) == "10.0.0.1:7000" and fallback({}) is None and "fallback" not in PrefillOp(
        "r", [1], 0.0, 1.0, None, shape).to_header()
    for bad in ("nohost", ":1", "h:0", "h:x", 7, ["h:1"]):
        with pytest.raises(KVWireError, match="fallback"):
            fallback({"fallback": bad})


def test_the_handed_back_header_is_one_typed_message() -> None:
    """HANDED_BACK_HEADER's value, built by the engine and parsed by the router (kascade_router.proxy) from one type:
    a prefill engine's data address, or the answering engine itself; anything else is refused naming the header."""
    from kascade_planner.engine_api import HANDED_BACK_HERE, HandedBack, WireError

    for msg in (HandedBack("10.0.0.7:9002"), HandedBack(None)):
        assert HandedBack.parse(msg.header()) == msg
    assert HandedBack(None).header() == HANDED_BACK_HERE
    for bad in ("", "10.0.0.7", "10.0.0.7:0", ":9002", "there"):
        with pytest.raises(WireError, match="X-Kascade-Handed-Back"):
            HandedBack.parse(bad)


def test_the_remote_path_estimate_follows_a_growing_queue() -> None:
    """What the hand-back compares with: the moving average of landed remote prefills, or the age of one still
    in flight when that is longer (a burst's queue at the prefill engine grows before any of it lands); with the
    peer's reported pace, that age plus the prompt tokens this engine queued there and the new prompt's."""
    from types import SimpleNamespace

    from kascade_engine.pd.remote_prefill import RemotePrefill

    rp = RemotePrefill(SimpleNamespace(transport=None, config=SimpleNamespace(token="t")))
    assert rp.expected_s("p:1") is None
    rp.took["p:1"] = 0.3
    assert rp.expected_s("p:1") == 0.3
    rp.pending["r1"] = ("p:1", time.monotonic() - 1.5, 400)  # sent 1.5 s ago, not landed
    rp.pending["r2"] = ("q:2", time.monotonic() - 9.0, 9000)  # another peer's queue says nothing of p:1
    assert 1.5 <= rp.expected_s("p:1") < 2.5  # type: ignore[operator]
    del rp.took["p:1"]
    assert 1.5 <= rp.expected_s("p:1", 100) < 2.5  # type: ignore[operator]  # no pace: tokens are not seconds
    # p:1 reported its pace (kv_done's rate): the prompt waits for the 400 tokens queued before it, then its own 100
    rp.pace["p:1"] = 200.0
    assert 1.5 + 2.5 <= rp.expected_s("p:1", 100) < 2.5 + 2.5  # type: ignore[operator]


async def test_the_answer_names_who_really_prefilled_a_handed_back_prompt(tiny_ckpt, tiny_blocks) -> None:
    """D, converted beside four streams, with a step budget that leaves a prompt nothing (so its measured rate is 0,
    or not measured yet): two prompts it is sent to prefill itself go to their fallback on arrival.
    - Fallback P alive: P prefills it, the answer names P's data port (HANDED_BACK_HEADER: the router moves the
      prefill load to P and tells the client X-Kascade-Prefilled-By).
    - Fallback dead (nothing listens): the remote prefill fails, D prefills it itself, and the answer names no
      prefill engine. Before 87267a2 the answer was decided at the hand-back and named the dead peer; now it is
      settled once the hand-back's prefill op went out to the peer (which a dead one never gets), else at the
      first token.
    Both answers equal the colocated one (D alone, before the conversion), streamed and not."""
    import socket

    import httpx

    from kascade_engine.http.server import create_app
    from kascade_planner.engine_api import HANDED_BACK_HEADER, PREFILL_FALLBACK_HEADER, ConvertRequest

    with socket.socket() as sk:  # a port nothing listens on: its connection is refused
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    d = pd.d
    app = create_app(d)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d",
                                     timeout=120) as c:
            async def ask(fallback: str | None, stream: bool) -> tuple[str, httpx.Headers]:
                body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                        "stream": stream}
                r = await c.post("/v1/completions", json=body,
                                 headers={PREFILL_FALLBACK_HEADER: fallback} if fallback else {})
                assert r.status_code == 200, r.text
                if not stream:
                    return r.json()["choices"][0]["text"], r.headers
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                               if line.startswith("data: {"))
                return text, r.headers

            want, _ = await ask(None, False)
            long = SamplingParams(max_tokens=200)
            streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
            tasks = [asyncio.create_task(collect(d, r)) for r in streams]
            while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
                await asyncio.sleep(0.005)
            d.convert(ConvertRequest(16, 30.0, hand_back_ms=100.0))
            d.engine.scheduler.cost = _NoRoom()
            for stream in (False, True):
                served, fell_back = pd.p.prefill_server.requests, d.remote_prefill.fallbacks
                text, h = await ask(pd.peer, stream)
                assert text == want and h.get(HANDED_BACK_HEADER) == pd.peer
                assert pd.p.prefill_server.requests == served + 1 and d.remote_prefill.fallbacks == fell_back
                text, h = await ask(dead, stream)  # D prefills it once its streams end (no room beside them)
                assert text == want and HANDED_BACK_HEADER not in h, h
                assert d.remote_prefill.fallbacks == fell_back + 1 and pd.p.prefill_server.requests == served + 1
                if not stream:  # the streams again, for the streamed pair
                    await asyncio.gather(*tasks)
                    streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
                    tasks = [asyncio.create_task(collect(d, r)) for r in streams]
                    while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
                        await asyncio.sleep(0.005)
            assert d.handback.handed == 4  # every one went to its fallback (on arrival, or after the bound)
            await asyncio.gather(*tasks)
    finally:
        await pd.close()


async def test_a_converted_decoder_prefilling_for_another_decoder_hands_back_by_the_same_rule(
    tiny_ckpt, tiny_blocks
) -> None:
    """D2, converted, decodes four streams and prefills for decoder D1 (the router may name a converted decoder as
    D1's prefill engine). It follows the rule it applies to the prompts it prefills itself (handback.py):
    - right after its conversion, with no prefill rate it can use (not measured, or 0 beside the streams), it
      declines D1's prompt at once: D1 prefills it on the fallback prefill engine P its prefill op names;
    - with a rate measured > 0 it takes the prompt; its step budget then leaving it no progress, it gives the prompt
      back after its bound: D1 prefills it on P, queued there by its arrival at D1;
    - with no fallback named, D1 prefills a given-back prompt itself.
    Greedy output equals the colocated engine's each time, and D2 holds none of them afterwards. Before, D2 kept
    such a prompt at 0 tokens a step until its streams ended (the second and third wait for them here)."""
    from pdpair import TOKEN, instance

    from kascade_engine.net.transport_tcp import TcpTransport
    from kascade_planner.engine_api import ConvertRequest

    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS[:1], params)[0]
    long = SamplingParams(max_tokens=480)
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    d1, p = pd.d, pd.p
    d2 = instance(tiny_ckpt, tiny_blocks, "d2", token=TOKEN)
    d2.serving.start()
    listener = await TcpTransport().listen("127.0.0.1", 0, lambda c: d2.finisher.handle(c))
    d2_peer = f"127.0.0.1:{listener.port}"
    try:
        streams = [d2.serving.submit([7 + i, 8, 9], long) for i in range(4)]
        tasks = [asyncio.create_task(collect(d2, r)) for r in streams]
        while not all(d2.engine.requests.get(r) and d2.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        arrivals: list[float | None] = []
        p_submit = p.engine.submit

        def spy(*a: Any, **kw: Any) -> str:
            arrivals.append(kw.get("arrived"))
            return p_submit(*a, **kw)

        p.engine.submit = spy
        d2.convert(ConvertRequest(16, 1000.0, hand_back_ms=100.0))
        d2.engine.scheduler.cost = _NoRoom()
        got = await asyncio.wait_for(collect(d1, d1.serving.submit(PROMPTS[0], params, prefill=d2_peer,
                                                                    fallback=pd.peer)), 60)
        assert got == want
        assert d2.handback.at_arrival == d2.handback.handed == 1 and d1.remote_prefill.handed_back == 1
        assert p.prefill_server.requests == 1 and d2.prefill_server.requests == 0 and len(arrivals) == 1

        # new budgets: the probe measures a rate > 0 with the real step cost; then no room again
        d2.engine.scheduler.cost = d2.engine.cost
        d2.convert(ConvertRequest(16, 999.0, hand_back_ms=100.0))
        while d2.probe.rid is not None:
            await asyncio.sleep(0.005)
        assert (d2.engine.meter.prefill_rate() or 0) > 0
        d2.engine.scheduler.cost = _NoRoom()  # the rate decays, stays > 0 a while
        t0 = time.monotonic()
        got = await asyncio.wait_for(collect(d1, d1.serving.submit(PROMPTS[0], params, prefill=d2_peer,
                                                                    fallback=pd.peer)), 60)
        assert got == want and time.monotonic() - t0 >= 0.1  # held for D2's bound first
        assert d2.handback.handed == 2 and d2.handback.at_arrival == 1 and d1.remote_prefill.handed_back == 2
        assert p.prefill_server.requests == 2 and len(arrivals) == 2
        assert arrivals[1] is not None and abs(arrivals[1] - t0) < 0.05, (arrivals, t0)  # queued by its arrival

        fell_back = d1.remote_prefill.fallbacks
        got = await asyncio.wait_for(collect(d1, d1.serving.submit(PROMPTS[0], params, prefill=d2_peer)), 60)
        assert got == want
        assert d2.handback.handed == 3 and d1.remote_prefill.handed_back == 3
        assert p.prefill_server.requests == 2 and d1.remote_prefill.fallbacks == fell_back  # prefilled on D1
        assert not all(t.done() for t in tasks), "D2's streams ended first: nothing was held"
        assert not any(r.startswith("pd-") for r in d2.engine.requests), "D2 still holds a prompt it gave back"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await d2.close()
        await listener.close()
        await pd.close()
