"""The router's `route` setting through the real router to real engine processes: two engines serve one model,
one of them slow (`--emulate-layer-ms`: every step takes at least 4 x 60 ms). Requests come one at a time, so
(in flight + 1) / weight is 1 on both at every pick and "share" splits them evenly, while "ttft" measures the
slow engine's first tokens (kascade_router.proxy times each request's first token at the engine that prefilled
it) and sends nearly every request to the fast one once it has a rate. A proxy that ignored the setting, or
recorded no first tokens, would give both runs the same split. The first tokens are timed at the first token,
not the first byte: a chat answer's role event comes before the prompt is even prefilled."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_engine.checkpoint import tiny_llama
from kascade_router.firsttoken import MIN_SPAN_S, MIN_TOKENS
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings

TOKEN = "router-ttft-token"
LAYERS = 4
SLOW_LAYER_MS = 60.0  # the slow engine's step: >= LAYERS x this (one prefill step before a first token)
N = 48  # requests per run


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("ttft") / "tiny-llama", layers=LAYERS, hidden=64, vocab=512)
    procs: list[EngineProc] = []
    try:
        for extra in ([], ["--emulate-layer-ms", str(SLOW_LAYER_MS)]):
            procs.append(start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "4096",
                                       *extra], TOKEN))
        yield {"fast": procs[0].http, "slow": procs[1].http}
    finally:
        for e in procs:
            e.stop()


async def _stream(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, object]) -> str:
    """One streamed answer through the router: the pod that answered (its text is read to the end)."""
    async with s.post(f"{url}{path}", json={"model": "tiny-llama", "stream": True, "temperature": 0, **body},
                      timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        assert events and all("error" not in e for e in events), events
        return r.headers["X-Kascade-Replica"]


async def _run(route: str, spec: str) -> tuple[Counter[str], Router, dict[str, Any]]:
    """N completions one after another through a fresh router (nothing measured) with `route`: requests per pod,
    the router, its routing table (/router/v1/routes) at the end."""
    r = await Router(RouterSettings(route=route, hold_timeout_s=10.0), static_routes([spec])).start()
    counts: Counter[str] = Counter()
    url = f"http://127.0.0.1:{r.port}"
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(N):
                counts[await _stream(s, url, "/v1/completions", {"prompt": [1 + i % 7, 2, 3, 4], "max_tokens": 2})] += 1
            async with s.get(f"{url}/router/v1/routes") as resp:
                table = {b["pod"]: b for b in (await resp.json())["tiny-llama"]["backends"]}
    finally:
        await r.close()
    return counts, r, table


async def test_the_ttft_rule_sends_fewer_requests_to_a_slow_engine_than_the_share_rule(
        engines: dict[str, int]) -> None:
    spec = f"tiny-llama=127.0.0.1:{engines['fast']},127.0.0.1:{engines['slow']}"
    fast, slow = "tiny-llama-0", "tiny-llama-1"  # static_routes names pods in order
    share, _, _ = await _run("share", spec)
    ttft, r, table = await _run("ttft", spec)
    print(f"requests to the slow engine: share {share[slow]} of {N}, ttft {ttft[slow]} of {N}")
    assert share[slow] + share[fast] == N == ttft[slow] + ttft[fast]
    # share: nothing is ever in flight at a pick, so every pick is a coin toss (~N/2 each)
    assert share[slow] >= N // 4, share
    # ttft: the slow engine gets requests only until the rule has a rate (MIN_TOKENS + 1 first tokens over
    # MIN_SPAN_S of its busy time, ~5 of its ~0.3 s first tokens); from then on the fast one's latency wins
    assert ttft[slow] <= min(share[slow] // 2, 2 * (MIN_TOKENS + 1)), (ttft, share)
    # what the proxy measured, per backend: the slow engine's TTFT holds at least its prefill step
    bs = {b.pod: b for b in r.routes.backends[("static", "tiny-llama")].values()}
    s_ft, f_ft = bs[slow].first_tokens, bs[fast].first_tokens
    assert s_ft.latency_s is not None and f_ft.latency_s is not None
    assert s_ft.latency_s >= LAYERS * SLOW_LAYER_MS / 1000 > f_ft.latency_s
    assert s_ft.busy_s >= MIN_SPAN_S and s_ft.waiting == 0 == f_ft.waiting
    assert table[slow]["firstTokens"]["latencySeconds"] == s_ft.latency_s  # shown in the routing table
    assert table[slow]["firstTokens"]["ratePerSecond"] > 0 and table[slow]["firstTokens"]["waiting"] == 0
    assert bs[slow].in_flight == bs[fast].in_flight == bs[slow].prefilling == bs[fast].prefilling == 0


async def test_a_chat_answers_first_token_is_timed_after_its_role_event(engines: dict[str, int]) -> None:
    """The engine streams a chat answer's role event at once, before the prefill: timing the first byte, the
    slow engine's TTFT would read ~0 and the rule would send it everything."""
    r = await Router(RouterSettings(hold_timeout_s=10.0),
                     static_routes([f"tiny-llama=127.0.0.1:{engines['slow']}"])).start()
    try:
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(_stream(s, f"http://127.0.0.1:{r.port}", "/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": n})
                                   for n in (1, 2)))
        (b,) = r.routes.backends[("static", "tiny-llama")].values()
        assert b.first_tokens.latency_s is not None
        assert b.first_tokens.latency_s >= LAYERS * SLOW_LAYER_MS / 1000, b.first_tokens
        assert b.first_tokens.waiting == 0 and b.in_flight == b.prefilling == 0
    finally:
        await r.close()
