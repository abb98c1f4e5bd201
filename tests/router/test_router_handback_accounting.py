"""The router counts and times a handed-back prompt on the engine that really prefills it, from the hand-back on, and
tells the client who that is, on REAL engine processes (a tiny random Llama on CPU).

- D1 decodes, D2 is a converted decoder busy with four long streams and a step budget its decodes alone exceed (its
  prefill rate is 0 or not measured: it declines every prompt on arrival), P is a prefill engine whose KV-shipping
  forward is slowed by an emulated knee (a 40-token prompt takes >= 0.4 s there), so the interval between the
  hand-back and the first token is long enough to see;
- D1 for D2: the router's table makes D1 the decoder and D2 its prefill engine (`X-Kascade-Prefill: D2`, P named in
  `X-Kascade-Prefill-Fallback`). D2 declines, D1 sends the prompt to P and answers once the op went out
  (`X-Kascade-Handed-Back: P`). While P prefills, the router counts the prompt on P (in flight and prefilling) and
  no longer on D2; the client's `X-Kascade-Prefilled-By` names P; P's first-token latency is P's prefill time, and
  D2 recorded none. Before, the prompt stayed on D2 until its first token, P was never counted, P's
  first tokens recorded nothing and the header named D2;
- D2 for itself: the table makes D2 the decoder and its own prefill engine (P the fallback). D2 declines on arrival
  and now answers once the op went to P, so P's first-token latency is again P's prefill time; before, D2 answered
  at the first token and the router timed P's first token from then: a TTFT of a few ms, which became P's latency.
Greedy text equals D1's colocated answer both times.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from pdtrio import PROMPT, convert_beside_streams, end_streams, engine_procs, trio_routes

from kascade_devcluster.localengine import EngineProc
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.backends import Backend
from kascade_router.server import Router

TOKEN = "router-handback-accounting-token"
LAYERS, P_LAYER_MS, KNEE = 4, 20, 8
P_PREFILL_S = LAYERS * P_LAYER_MS / 1e3 * len(PROMPT) / KNEE  # 0.4 s: P's KV-shipping forward at the knee
# The least of P's prefill the router can see. Its clock starts when the decoder's answer arrives (the hand-back
# header), after the decoder sent P the op, so P has prefilled for that gap already: the decoder's and the router's
# event loops, unbounded on a loaded machine (P's latency measured 0.297 s beside other suites on 2 cores, under the
# 0.75 x once asserted). A quarter still tells P's prefill apart from what the old accounting gave: None, a few ms.
SEEN_S = 0.25 * P_PREFILL_S


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("accounting") / "tiny-llama", layers=LAYERS, hidden=64, vocab=512)
    # D2's steps take >= 32 ms (an emulated accelerator): its streams outlast both requests on a loaded machine
    with engine_procs(
        ckpt,
        TOKEN,
        64,
        {
            "d2": ["--emulate-layer-ms", "8"],
            "p": ["--emulate-layer-ms", str(P_LAYER_MS), "--emulate-knee-tokens", str(KNEE)],
        },
    ) as procs:
        yield procs


Snapshot = tuple[float, int, int, int, int]  # (seconds since sent, D2 in flight, P in flight, D2 prefilling, P's)


async def _ask(s: aiohttp.ClientSession, port: int, d2: Backend, p: Backend) -> tuple[str, dict[str, str],
                                                                                      list[Snapshot]]:
    """One streamed completion through the router; the router's counts of D2 and P every ~2 ms meanwhile."""
    seen: list[Snapshot] = []
    t0 = time.monotonic()

    async def watch() -> None:
        while True:
            seen.append((time.monotonic() - t0, d2.in_flight, p.in_flight, d2.prefilling, p.prefilling))
            await asyncio.sleep(0.002)

    w = asyncio.create_task(watch())
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    try:
        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert r.status == 200, await r.text()
            text = "".join([json.loads(line[6:])["choices"][0]["text"]
                            async for line in r.content if line.startswith(b"data: {")])
            return text, dict(r.headers), seen
    finally:
        w.cancel()


async def test_a_handed_back_prompt_is_counted_timed_and_named_at_the_engine_that_prefills_it(
        engines: dict[str, EngineProc]) -> None:
    urls = {n: f"http://127.0.0.1:{e.http}" for n, e in engines.items()}
    routes, b_d1, b_d2, b_p = trio_routes(engines)
    router = await Router(routes=routes).start()
    ref: dict[str, Any] = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{urls['d1']}/v1/completions", json=ref) as r:  # colocated reference: D1 alone
                want = (await r.json())["choices"][0]["text"]
            streams = await convert_beside_streams(s, urls["d2"], TOKEN)

            # D1 for D2: D2 streams much (D1 decodes), P prefills much (so D2 is the cheaper prefill candidate)
            b_d2.in_flight, b_p.in_flight = 50, 50
            served, served_h, seen = await _ask(s, router.port, b_d2, b_p)
            served_ft = (b_d2.first_tokens.latency_s, b_p.first_tokens.latency_s)
            after_served = (b_d1.in_flight, b_d2.in_flight, b_p.in_flight, b_d2.prefilling, b_p.prefilling)

            # D2 for itself: D1 decodes much more, so D2 decodes it and, cheaper than P, prefills it itself
            b_p.first_tokens = type(b_p.first_tokens)()
            b_d1.in_flight = 100
            own, own_h, _ = await _ask(s, router.port, b_d2, b_p)
            own_ft = b_p.first_tokens.latency_s
            running = await end_streams(s, urls["d2"], TOKEN, streams)
    finally:
        await router.close()

    assert all(running), "D2's streams ended first: it had no decodes, and the arrival rule keeps such a prompt"
    assert served == want and own == want
    # D1 for D2: from the hand-back on, on P (in flight, prefilling), not on D2
    on_p = [x for x in seen if x[1:] == (50, 51, 0, 1)]
    on_d2 = [x for x in seen if x[1:] == (51, 50, 1, 0)]
    print(
        f"\nD1 for D2: on D2 from 0 to {max((x[0] for x in on_d2), default=0.0):.3f} s, on P from "
        f"{min((x[0] for x in on_p), default=float('nan')):.3f} to "
        f"{max((x[0] for x in on_p), default=float('nan')):.3f}"
        f" s ({len(on_p)} of {len(seen)} samples); P's first-token latency {served_ft[1]}; D2's {served_ft[0]}"
    )
    assert on_p and max(x[0] for x in on_p) - min(x[0] for x in on_p) >= SEEN_S, seen
    assert all(x[0] < min(x[0] for x in on_p) for x in on_d2)  # D2 only before the hand-back
    assert served_h["X-Kascade-Replica"] == "tiny-llama-0" and served_h.get("X-Kascade-Prefilled-By") == "tiny-llama-2"
    assert served_ft[0] is None and served_ft[1] is not None and served_ft[1] >= SEEN_S, served_ft
    assert after_served == (0, 50, 50, 0, 0)  # the router's accounting given back
    # D2 for itself: timed at P from the hand-back, not from D2's answer at the first token (a few ms)
    print(f"D2 for itself: P's first-token latency {own_ft}")
    assert own_h["X-Kascade-Replica"] == "tiny-llama-1" and own_h.get("X-Kascade-Prefilled-By") == "tiny-llama-2"
    assert own_ft is not None and own_ft >= SEEN_S, own_ft
    assert (b_d1.in_flight, b_d2.in_flight, b_p.in_flight, b_d2.prefilling, b_p.prefilling) == (100, 50, 50, 0, 0)
