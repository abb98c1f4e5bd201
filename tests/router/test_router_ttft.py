"""The router's `route` setting through the real router to real engine processes: two engines serve one model,
one of them slow (`--emulate-layer-ms`: every step takes at least 4 x 60 ms); in disaggregated serving, two
prefill engines for one decoder, one of them slow (1 prompt token a step). Requests come one at a time, so
(in flight + 1) / weight is 1 on both at every pick and "share" splits them evenly, while "ttft" measures the
slow engine's first tokens (kascade_router.proxy times each request's first token at the engine that prefilled
it) and sends nearly every request to the fast one once it has timed one there (nothing is ever ahead, so the
expected TTFT is the latency; no rate is needed). A proxy that ignored the setting, or
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
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.firsttoken import MIN_TOKENS
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings

TOKEN = "router-ttft-token"
LAYERS = 4
SLOW_LAYER_MS = 60.0  # the slow engine's step: >= LAYERS x this (one prefill step before a first token)
N = 48  # requests per run
PD_BUDGET = 1  # the slow prefill engine's --max-batch-tokens
PD_PROMPT = 160  # prompt tokens in the PD test: PD_PROMPT / PD_BUDGET steps at the slow prefill engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    """fast, slow (every step >= LAYERS x SLOW_LAYER_MS), a plain one (the decoder of the PD test) and a slow
    prefill engine: `--emulate-layer-ms` does not pace a prefill engine's KV-shipping forward (measured: 8 ms
    TTFT through it, as through the fast one), so that one is slow by its step budget: PD_BUDGET prompt tokens
    a step, PD_PROMPT steps for one prompt."""
    ckpt = tiny_llama(tmp_path_factory.mktemp("ttft") / "tiny-llama", layers=LAYERS, hidden=64, vocab=512)
    procs: list[EngineProc] = []
    try:
        for extra in ([], ["--emulate-layer-ms", str(SLOW_LAYER_MS)], [], ["--max-batch-tokens", str(PD_BUDGET)]):
            procs.append(start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "4096",
                                       "--transport", "tcp", *extra], TOKEN))
        yield dict(zip(("fast", "slow", "decode", "slow_prefill"), procs, strict=True))
    finally:
        for e in procs:
            e.stop()


async def _stream(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, object],
                  header: str = "X-Kascade-Replica") -> str:
    """One streamed answer through the router: the pod `header` names (the one that answered by default; the
    answer is read to the end)."""
    async with s.post(f"{url}{path}", json={"model": "tiny-llama", "stream": True, "temperature": 0, **body},
                      timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        assert events and all("error" not in e for e in events), events
        return r.headers[header]


async def _run(route: str, spec: str, header: str = "X-Kascade-Replica", prompt: int = 4
               ) -> tuple[Counter[str], Router, dict[str, Any]]:
    """N completions one after another through a fresh router (nothing measured) with `route`: requests per pod
    named by `header`, the router, its routing table (/router/v1/routes) at the end."""
    r = await Router(RouterSettings(route=route, hold_timeout_s=10.0), static_routes([spec])).start()
    counts: Counter[str] = Counter()
    url = f"http://127.0.0.1:{r.port}"
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(N):
                counts[
                    await _stream(
                        s,
                        url,
                        "/v1/completions",
                        {"prompt": [1 + (i + j) % 300 for j in range(prompt)], "max_tokens": 2},
                        header,
                    )
                ] += 1
            async with s.get(f"{url}/router/v1/routes") as resp:
                table = {b["pod"]: b for b in (await resp.json())["tiny-llama"]["backends"]}
    finally:
        await r.close()
    return counts, r, table


async def test_the_ttft_rule_sends_fewer_requests_to_a_slow_engine_than_the_share_rule(
        engines: dict[str, EngineProc]) -> None:
    spec = f"tiny-llama=127.0.0.1:{engines['fast'].http},127.0.0.1:{engines['slow'].http}"
    fast, slow = "tiny-llama-0", "tiny-llama-1"  # static_routes names pods in order
    share, _, _ = await _run("share", spec)
    ttft, r, table = await _run("ttft", spec)
    print(f"requests to the slow engine: share {share[slow]} of {N}, ttft {ttft[slow]} of {N}")
    assert share[slow] + share[fast] == N == ttft[slow] + ttft[fast]
    # share: nothing is ever in flight at a pick, so every pick is a coin toss (~N/2 each)
    assert share[slow] >= N // 4, share
    # ttft: the slow engine gets requests only until the rule has timed a first token on each (coin tosses while
    # one is unmeasured); from then on the fast one's latency wins. The bound is what a rate would take
    # (MIN_TOKENS + 1 first tokens): waiting for one, a slow engine under load got half the requests
    assert ttft[slow] <= 2 * (MIN_TOKENS + 1) < N // 4, (ttft, share)  # so fewer than under share
    # what the proxy measured, per backend: the slow engine's TTFT holds at least its prefill step
    bs = {b.pod: b for b in r.routes.backends[("static", "tiny-llama")].values()}
    s_ft, f_ft = bs[slow].first_tokens, bs[fast].first_tokens
    assert s_ft.latency_s is not None and f_ft.latency_s is not None
    assert s_ft.latency_s >= LAYERS * SLOW_LAYER_MS / 1000 > f_ft.latency_s
    assert s_ft.busy_s >= s_ft.latency_s and s_ft.waiting == 0 == f_ft.waiting
    assert table[slow]["firstTokens"]["latencySeconds"] == s_ft.latency_s  # shown in the routing table
    assert table[slow]["firstTokens"]["waiting"] == 0
    assert bs[slow].in_flight == bs[fast].in_flight == bs[slow].prefilling == bs[fast].prefilling == 0


async def test_of_two_prefill_engines_the_ttft_rule_sends_fewer_prompts_to_the_slow_one(
        engines: dict[str, EngineProc]) -> None:
    """Disaggregated: one decoder, the fast and the slow engine as prefill engines. The decoder is picked by share
    either way (the only one); the prefill engine by the rule. Under share both prefill engines hold 0 prompts at
    every pick (a coin toss); under ttft the first tokens, timed at the prefill engine that prefilled each
    prompt, steer prompts away from the slow one."""
    f, sl, d = engines["fast"], engines["slow_prefill"], engines["decode"]
    spec = (f"tiny-llama=decode@127.0.0.1:{d.http},prefill@127.0.0.1:{f.http}+127.0.0.1:{f.act},"
            f"prefill@127.0.0.1:{sl.http}+127.0.0.1:{sl.act}")
    fast, slow = "tiny-llama-1", "tiny-llama-2"
    share, _, _ = await _run("share", spec, "X-Kascade-Prefilled-By", PD_PROMPT)
    ttft, r, _ = await _run("ttft", spec, "X-Kascade-Prefilled-By", PD_PROMPT)
    print(f"prompts prefilled by the slow engine: share {share[slow]} of {N}, ttft {ttft[slow]} of {N}")
    assert share[slow] + share[fast] == N == ttft[slow] + ttft[fast]
    assert share[slow] >= N // 4, share
    assert ttft[slow] <= 2 * (MIN_TOKENS + 1) < N // 4, (ttft, share)  # so fewer than under share
    bs = {b.pod: b for b in r.routes.backends[("static", "tiny-llama")].values()}
    assert bs["tiny-llama-0"].first_tokens.latency_s is None  # the decoder prefilled nothing: nothing timed there
    s_lat, f_lat = bs[slow].first_tokens.latency_s, bs[fast].first_tokens.latency_s
    print(f"measured TTFT through the slow / fast prefill engine: {s_lat} / {f_lat} s")
    assert s_lat is not None and f_lat is not None and s_lat > 4 * f_lat  # PD_PROMPT steps against one
    assert all(b.in_flight == b.prefilling == b.first_tokens.waiting == 0 for b in bs.values())


async def test_a_chat_answers_first_token_is_timed_after_its_role_event(engines: dict[str, EngineProc]) -> None:
    """The engine streams a chat answer's role event at once, before the prefill: timing the first byte, the
    slow engine's TTFT would read ~0 and the rule would send it everything."""
    r = await Router(RouterSettings(hold_timeout_s=10.0),
                     static_routes([f"tiny-llama=127.0.0.1:{engines['slow'].http}"])).start()
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
