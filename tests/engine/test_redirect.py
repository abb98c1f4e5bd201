"""Request redirection (BlitzScale): a source A with a queue hands requests it has not started to its
live pair B over the pair connection; B runs them split (its prefix on B, the rest in A's batch) and A
streams their tokens to its own clients. Outputs equal the unsplit engine's; a client that leaves
aborts its request on B; the redirected requests opened no connection of their own; B going away
mid-request (released, scaled down) costs A's clients nothing: A takes their requests back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from splitref import collect, unsplit

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import CooperateRequest

PROMPTS = [[11, 42, 7, 300, 5], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17], [100], [5, 6, 7, 8], [3, 1, 4, 1, 5]]


def _instance(ckpt: Path, blocks: Any, resident: int | None, name: str, start: bool = True) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token="redirect-token", kv_tokens=2048,
                       max_batch_tokens=64, max_seqs=1, instance=name, resident_layers=resident)
    inst = EngineInstance(cfg, blocks.config, ByteTokenizer(), blocks)
    if start:
        inst.serving.start()
    return inst


def _copy(d: dict[str, Any]) -> list[Any]:
    """The values of a dict the engine's step thread may be changing right now."""
    while True:
        try:
            return list(d.values())
        except RuntimeError:  # changed size during the copy: try again
            continue


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=6),
                                    SamplingParams(max_tokens=5, temperature=0.8, seed=7)], ids=["greedy", "seeded"])
async def test_queued_requests_on_the_source_are_redirected_to_the_live_target(tiny_ckpt, tiny_blocks, params) -> None:
    want = unsplit(tiny_blocks, PROMPTS, params)
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", start=False)  # one sequence at a time: the rest queue
    b = _instance(tiny_ckpt, tiny_blocks, 2, "b")
    lst = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    try:
        rids = [a.serving.submit(p, params) for p in PROMPTS]
        runs = [asyncio.create_task(collect(a, r)) for r in rids]
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))
        a.serving.start()  # A's first step sees its queue of 5 and B's poll (not a race with A's speed)
        assert await asyncio.gather(*runs) == want  # every client of A gets exactly the unsplit output
        pc = b.pair
        assert pc is not None
        handed = a.host.redirects.total
        assert handed >= 1 and pc.received == handed  # A handed queued requests over; B took every one
        ran_on_b = {rid for rid, _ in pc.history}
        assert 1 <= len(ran_on_b & set(rids)) == handed  # they ran in B's batch under their own ids
        assert a.finisher.connections == 1  # the pair's one connection carried them all
        assert not a.host.redirects.handed  # every handed request finished on A's side
        while b.engine.requests:  # B applies the last token it got back, then forgets the request too
            await asyncio.sleep(0.005)
    finally:
        await b.close()
        await a.close()
        await lst.close()


def test_frames_answered_at_one_step_end_hand_over_only_what_evens_the_queues(tiny_ckpt, tiny_blocks) -> None:
    """B keeps several steps out, so A answers two of its frames at one step's end, both reporting the queue B had
    before this step's hand-overs. The second must count what the first handed over (in transit: A's count sent
    minus B's "seen"), or A hands over its whole queue, the requests its own next step would run among them."""
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", start=False)
    eng, r = a.engine, a.host.redirects
    for p in PROMPTS[:5]:
        eng.submit(p, SamplingParams(max_tokens=4))
    first = r.pick(eng, 0, 0, 0)  # B: nothing queued, nothing received yet
    second = r.pick(eng, 0, 0, 0)  # B's next frame, sent before it read `first`
    assert (len(first), second, len(eng.scheduler.waiting)) == (2, [], 3)  # 3 here, 2 on their way to B
    assert len(r.pick(eng, 0, 0, 2)) == 1  # B read both and started them: A evens the queues again (2 vs 1)
    assert r.pick(eng, 0, 1, 2) == []  # one still on its way (sent 3, seen 2) and one queued there: even
    r.close_pair(eng, 0)  # a new session starts counting from zero
    assert r.sent == {}


async def test_a_client_leaving_aborts_its_redirected_request_on_the_target(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=2000)
    short = SamplingParams(max_tokens=4)
    want = unsplit(tiny_blocks, PROMPTS[:1], short)
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", start=False)
    b = _instance(tiny_ckpt, tiny_blocks, 2, "b")
    lst = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    try:
        first = a.serving.submit(PROMPTS[0], short)
        queued = [a.serving.submit(p, params) for p in PROMPTS[1:]]
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))
        a.serving.start()
        pc = b.pair
        assert pc is not None
        while not (moving := [h.rid for h in _copy(a.host.redirects.handed) if h.out]):  # one runs on B
            await asyncio.sleep(0.005)
        moved = moving[0]
        assert moved in pc.redirected
        stream = a.serving.tokens(moved)
        await stream.__anext__()  # its client got a token (sampled on A for B's row) ...
        await stream.aclose()  # ... and leaves
        while (r := b.engine.requests.get(moved)) is not None:  # the abort reaches B: its sequence goes
            assert len(r.out) < 1000, "B kept generating for a client that left"
            await asyncio.sleep(0.005)
        assert await collect(a, first) == want[0]
        for rid in queued:
            if rid != moved:
                a.serving.abort(rid)
    finally:
        await b.close()
        await a.close()
        await lst.close()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24),
                                    SamplingParams(max_tokens=24, temperature=0.8, seed=11)], ids=["greedy", "seeded"])
async def test_the_target_going_away_mid_request_hands_redirected_requests_back_to_the_source(
        tiny_ckpt, tiny_blocks, params) -> None:
    want = unsplit(tiny_blocks, PROMPTS, params)
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", start=False)
    b = _instance(tiny_ckpt, tiny_blocks, 2, "b")
    lst = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    closed = False
    try:
        rids = [a.serving.submit(p, params) for p in PROMPTS]
        got: dict[str, list[int]] = {r: [] for r in rids}

        async def run(rid: str) -> list[int]:
            async for ev in a.serving.tokens(rid):
                got[rid].append(ev.token)
            return got[rid]

        runs = [asyncio.create_task(run(r)) for r in rids]
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))
        a.serving.start()
        while not any(len(got[h.rid]) >= 2 for h in _copy(a.host.redirects.handed)):  # mid-generation on B
            await asyncio.sleep(0.002)
        assert not any(r.done() for r in runs[1:])
        await b.close()  # B goes away (released) with A's handed requests unfinished
        closed = True
        # before the take-back (the old code) these clients got "the live peer it was redirected to went away"
        assert await asyncio.gather(*runs) == want
        assert a.host.redirects.taken_back >= 1 and not a.host.redirects.handed
        assert not a.engine.requests  # nothing left behind on A either
    finally:
        if not closed:
            await b.close()
        await a.close()
        await lst.close()


async def test_a_target_without_its_embed_block_takes_no_requests_until_it_lands(tiny_ckpt, tiny_blocks) -> None:
    """Issue 38 defect 5: right after `cooperate` the target's `embed` block may not be resident yet (blocks land
    in any order); a request handed to it then failed its step ("block embed is not resident"). The target asks
    for no requests and admits none of its own before embed is here; once it lands every request completes with
    the unsplit output and none failed."""
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS, params)
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", start=False)  # one sequence at a time: the rest queue
    b = _instance(tiny_ckpt, tiny_blocks, 2, "b")
    embed = b.model.weights.pop("embed")  # layers 0..1 landed before embed
    lst = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    try:
        rids = [a.serving.submit(p, params) for p in PROMPTS]
        runs = [asyncio.create_task(collect(a, r)) for r in rids]
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))
        pc = b.pair
        assert pc is not None
        own = b.serving.submit(PROMPTS[0], params)  # B's own client, admitted while embed is missing
        own_run = asyncio.create_task(collect(b, own))
        a.serving.start()
        await asyncio.sleep(0.5)  # A runs its queue meanwhile; B polls it, with no embed to run anything
        assert pc.received == 0 and not b.engine.requests  # nothing handed to B or run there yet
        b.model.weights["embed"] = embed  # embed lands
        b._settle()
        assert await asyncio.wait_for(asyncio.gather(*runs), 60) == want  # no client of A got an error
        assert await asyncio.wait_for(own_run, 60) == want[0]
    finally:
        await b.close()
        await a.close()
        await lst.close()
