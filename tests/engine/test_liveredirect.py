"""Request redirection to a live pipeline (liveredirect.py): a serving source with a queue hands the requests
it has not started to the head of an execute-while-load pipeline (λScale: three receivers, none holding the
whole model); the pipeline runs them and their tokens stream back to the source's clients. Outputs equal
the unsplit engine's; the head going away mid-request costs the clients nothing (the source takes them back);
on real engine processes, the redirect session is what moves them (without it, none move)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitref import collect, unsplit

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transport import Listener
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import CooperateRequest

PROMPTS = [[11, 42, 7, 300, 5], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17], [100], [5, 6, 7, 8], [3, 1, 4, 1, 5],
           [200, 201, 202], [7, 7, 7, 7]]


def _instance(ckpt: Path, blocks: Any, ids: list[str] | None, name: str, max_seqs: int = 8,
              layer_s: float = 0.0) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token="fwd-token", kv_tokens=2048,
                       max_batch_tokens=64, max_seqs=max_seqs, instance=name)
    inst = EngineInstance(cfg, blocks.config, ByteTokenizer(), blocks if ids is None else None)
    for bid in ids or []:
        inst.add_block(blocks.blocks[bid])
    inst.host.layer_s = layer_s
    return inst


@asynccontextmanager
async def _world(ckpt: Path, blocks: Any) -> AsyncIterator[tuple[EngineInstance, EngineInstance, list[Listener]]]:
    """Source A (whole model, one sequence at a time, slow: a queue builds) and a pipeline r1 -> r2 -> r3 whose
    head r1 takes A's queue; (A, r1, listeners of r1, r2, r3)."""
    a = _instance(ckpt, blocks, None, "a", max_seqs=1, layer_s=0.01)
    r1 = _instance(ckpt, blocks, ["embed", "layer.0", "layer.1"], "r1")
    r2 = _instance(ckpt, blocks, ["layer.2"], "r2")
    r3 = _instance(ckpt, blocks, ["layer.3", "head"], "r3")
    for i in (r1, r2, r3):
        i.serving.start()
    listeners = [await TcpTransport().listen("127.0.0.1", 0, i.finisher.handle) for i in (r1, r2, r3)]
    try:
        await r2.set_cooperate(CooperateRequest(f"127.0.0.1:{listeners[2].port}", "pipeline"))
        await r1.set_cooperate(CooperateRequest(f"127.0.0.1:{listeners[1].port}", "besteffort"))
        yield a, r1, listeners
    finally:
        for i in (a, r1, r2, r3):
            await i.close()
        for lst in listeners:
            await lst.close()


async def test_queued_requests_on_a_source_move_to_the_pipeline_and_stay_exact(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS, params)
    async with _world(tiny_ckpt, tiny_blocks) as (a, r1, listeners):
        assert not r1.model.complete and r1.serving_share > 1  # a pipeline head: worth more than one replica
        rids = [a.serving.submit(p, params) for p in PROMPTS]  # queued on A before it steps
        runs = [asyncio.create_task(collect(a, r)) for r in rids]
        head = f"127.0.0.1:{listeners[0].port}"
        st = await a.set_cooperate(CooperateRequest(head, "redirect"))
        assert st.extra["redirect"] == [head] and not st.cooperate
        a.serving.start()
        assert await asyncio.gather(*runs) == want  # every client of A gets exactly the unsplit output
        fwd = a.forwarders[head]
        assert fwd.total >= 2 and r1.forward_host.received == fwd.total  # the queue's tail moved; r1 took every one
        assert fwd.taken_back == 0 and not fwd.handed
        assert r1.finisher.connections == 1  # the one redirect session carried them all
        m = a.metrics.registry.get_sample_value("kascade_live_redirected_requests_total", {"model_name": "tiny-llama"})
        assert m == fwd.total
        await a.set_cooperate(CooperateRequest("", "off"))
        assert not a.forwarders and "redirect" not in a.status().extra


async def test_the_head_going_away_hands_forwarded_requests_back_to_the_source(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=30)
    want = unsplit(tiny_blocks, PROMPTS, params)
    async with _world(tiny_ckpt, tiny_blocks) as (a, r1, listeners):
        r1.host.layer_s = 0.02  # slow enough that the head is mid-request when it goes
        rids = [a.serving.submit(p, params) for p in PROMPTS]
        runs = [asyncio.create_task(collect(a, r)) for r in rids]
        head = f"127.0.0.1:{listeners[0].port}"
        await a.set_cooperate(CooperateRequest(head, "redirect"))
        a.serving.start()
        fwd = a.forwarders[head]
        deadline = time.monotonic() + 20
        while not any(h.out for h in list(fwd.handed.values())):  # one is mid-stream on the head
            assert time.monotonic() < deadline, "no forwarded request started on the head"
            await asyncio.sleep(0.005)
        await r1.close()  # the head goes away (its redirect session with it)
        await listeners[0].close()
        assert await asyncio.gather(*runs) == want  # nothing failed, nothing changed
        assert fwd.taken_back >= 1


async def test_redirect_needs_an_engine_that_serves(tiny_ckpt, tiny_blocks) -> None:
    b = _instance(tiny_ckpt, tiny_blocks, ["embed", "layer.0"], "b")  # loading, no peer: it serves nothing
    try:
        with pytest.raises(InstanceError, match="mode redirect: engine is loading"):
            await b.set_cooperate(CooperateRequest("127.0.0.1:1", "redirect"))
    finally:
        await b.close()


async def test_a_live_engine_never_hands_on_requests_its_pair_handed_it(tiny_ckpt, tiny_blocks, caplog) -> None:
    """Regression (31b366f): a live engine B holds two kinds of queued requests: its own clients' and those its
    pair's source A handed it over the pair session (redirect.py; their clients are on A, and their tokens must
    go back that way). B, told to redirect to a serving engine H, hands on only its own: one of A's sent on to H
    streamed its tokens to no client on B, and A's client waited until it timed out (bench full run, pipe2)."""
    params = SamplingParams(max_tokens=6)
    theirs, mine = PROMPTS, [[t + 1 for t in p] for p in PROMPTS]
    want = unsplit(tiny_blocks, theirs + mine, params)
    a = _instance(tiny_ckpt, tiny_blocks, None, "a", max_seqs=1)  # one sequence at a time: a queue, handed to B
    b = _instance(tiny_ckpt, tiny_blocks, ["embed", "layer.0"], "b", max_seqs=1)  # live with A: a queue of both
    h = _instance(tiny_ckpt, tiny_blocks, None, "h")  # serves whatever B hands it
    b.host.layer_s = 0.01  # B steps slowly: both kinds wait in its queue while its forwarder looks
    caplog.set_level(logging.INFO, logger="kascade_engine.batch.timeline")  # `a-forward <request>`: what B handed on
    lst_a = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    lst_h = await TcpTransport().listen("127.0.0.1", 0, h.finisher.handle)
    try:
        b.serving.start()
        h.serving.start()
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst_a.port}", "besteffort"))
        at_a = [a.serving.submit(p, params) for p in theirs]  # queued on A before it steps: A hands B its tail
        runs = [asyncio.create_task(collect(a, r)) for r in at_a]
        a.serving.start()
        deadline = time.monotonic() + 20
        while not a.host.redirects.total:
            assert time.monotonic() < deadline, "A handed B nothing: the test would test nothing"
            await asyncio.sleep(0.005)
        at_b = [b.serving.submit(p, params) for p in mine]
        runs += [asyncio.create_task(collect(b, r)) for r in at_b]
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst_h.port}", "redirect"))
        got = await asyncio.wait_for(asyncio.gather(*runs), 30)  # reverting the fix: A's clients never finish
        assert got == want  # every client, on A and on B, gets exactly the unsplit output
        fwd = b.forwarders[f"127.0.0.1:{lst_h.port}"]
        assert fwd.total >= 1  # B's forwarder did hand requests on: the rule, not an idle forwarder, kept A's
        assert h.forward_host.received == fwd.total and fwd.taken_back == 0
        forwarded = {m.group(1) for r in caplog.records if (m := re.search(r" a-forward (\S+) ", r.getMessage()))}
        assert len(forwarded) == fwd.total and forwarded <= set(at_b)  # B's own clients' only, none of A's
    finally:
        for i in (a, b, h):
            await i.close()
        for lst in (lst_a, lst_h):
            await lst.close()


# -- real engine processes ---------------------------------------------------------------------------------
def _metric(e: Any, name: str) -> float:
    text = httpx.get(e.url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _ctl(e: Any, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{e.url}/kascade/v1/{verb}", json=body, headers={"Authorization": f"Bearer {e.token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


async def _burst(e: Any, prompts: list[list[int]], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*(c.post(e.url + "/v1/completions", json={
            "model": "tiny-llama", "prompt": p, "max_tokens": max_tokens, "temperature": 0}) for p in prompts))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0]["text"] for r in rs]


@pytest.mark.slow
@pytest.mark.parametrize("redirect", [True, False], ids=["redirect", "without"])
def test_real_engines_a_source_hands_its_queue_to_a_live_replica(tiny_ckpt: Path, engine_starter: Any,
                                                                 redirect: bool) -> None:
    """Processes: source S (one sequence at a time, 60 ms per layer: a burst queues), live replica H (2 of 4
    layers resident, paired with a complete engine C). S told `redirect` to H: part of S's burst runs on H,
    outputs unchanged. Without the call nothing moves (the test of the test: the counters come from the
    mechanism, not from the burst)."""
    base = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--kv-tokens", "4096"]
    s = engine_starter([*base, "--max-seqs", "1", "--emulate-layer-ms", "60"])
    c = engine_starter(base)
    h = engine_starter([*base, "--resident-layers", "2"])
    try:
        burst = PROMPTS + [[t + 1 for t in p] for p in PROMPTS]
        want = asyncio.run(_burst(c, burst, 8))  # the unsplit engine's answers
        _ctl(h, "cooperate", {"peer": f"127.0.0.1:{c.act}", "mode": "besteffort"})
        if redirect:
            st = _ctl(s, "cooperate", {"peer": f"127.0.0.1:{h.act}", "mode": "redirect"})
            assert st["redirect"] == [f"127.0.0.1:{h.act}"]
        assert asyncio.run(_burst(s, burst, 8)) == want
        moved = _metric(s, "kascade_live_redirected_requests_total")
        received = _metric(h, "kascade_live_redirect_received_requests_total")
        if redirect:
            assert moved >= 2 and received == moved, (moved, received)
            assert _metric(s, "kascade_live_redirect_taken_back_requests_total") == 0
            _ctl(s, "cooperate", {"peer": "", "mode": "off"})
        else:
            assert moved == 0 and received == 0
    finally:
        for e in (s, c, h):
            e.stop()
