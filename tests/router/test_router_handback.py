"""The hand-back through the router, on REAL engine processes (a tiny random Llama on CPU): a converted decoder
D that the router lets prefill a prompt itself, but whose step budget leaves that prompt no room, hands it to
the prefill engine P the router named (PREFILL_FALLBACK_HEADER), and the client gets the exact answer.

- P (prefill) and D (decode, with a data port, convertible in the router's table); the colocated reference is
  D alone, which also times D's prompt steps (its step-cost model is fitted before the conversion);
- D decodes four long streams (480 tokens, at least 32 ms a step: an emulated accelerator) sent to it directly (so the
router holds no prefill-room report of D, as when
  its report is stale), then is converted with a step budget its decodes alone exceed (0.001 ms) and a 100 ms
  hand-back bound;
- a burst of prompts through the router: P takes most, D (prefilling none) takes at least one itself;
- every answer equals the colocated one; every prompt was prefilled on P (D's handed-back ones too), D handed
  back exactly the ones it took, and they were answered while D's streams still ran;
- the router learns of each hand-back (D's answer says where, X-Kascade-Handed-Back): every answer names P in
  X-Kascade-Prefilled-By, `kascade_router_prefill_handbacks` counts D's hand-backs, and its PD accounting
  (prefills in flight) is back to zero on both engines.
Fails without the hand-back: D's own prompt gets 0 tokens a step and waits for the streams to end (and P
prefills one prompt fewer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.engine_api import ConvertRequest
from kascade_router.server import Router, static_routes

TOKEN = "router-handback-token"
PROMPTS = [[(5 * i + 3 * j) % 500 + 1 for j in range(24 + 4 * i)] for i in range(6)]
STREAM_TOKENS = 480  # the tiny model's 512 positions hold it after a 3-token prompt


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("handback") / "tiny-llama", layers=4, hidden=64, vocab=512)
    procs: dict[str, EngineProc] = {}
    try:
        # D's steps take >= 32 ms: its streams last >= 15 s, longer than the burst even on a loaded machine
        # (with 12 ms steps they ended first in 1 full-suite run: the stranding the test needs was gone)
        for role, layer_ms in (("prefill", "0"), ("decode", "8")):
            procs[role] = start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens",
                                        "8192", "--max-batch-tokens", "32", "--emulate-layer-ms", layer_ms], TOKEN)
        yield procs
    finally:
        for e in procs.values():
            e.stop()


def _metric(text: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def _complete(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                    stream: bool) -> tuple[str, dict[str, str]]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["choices"][0]["text"], dict(r.headers)
        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return text, dict(r.headers)


async def _first_token_then_rest(s: aiohttp.ClientSession, url: str, prompt: list[int], started: asyncio.Event,
                                 ) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
    async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                started.set()
        return text


async def test_a_prompt_a_converted_decoder_has_no_room_for_is_served_by_the_prefill_engine_exactly(
        engines: dict[str, EngineProc]) -> None:
    p, d = engines["prefill"], engines["decode"]
    p_url, d_url = f"http://127.0.0.1:{p.http}", f"http://127.0.0.1:{d.http}"
    routes = static_routes([f"tiny-llama=decode@127.0.0.1:{d.http}+127.0.0.1:{d.act},"
                            f"prefill@127.0.0.1:{p.http}+127.0.0.1:{p.act}"])
    (backends,) = routes.backends.values()
    backends["tiny-llama-0"].convertible = True  # what the pod annotation kascade.io/convertible does
    router = await Router(routes=routes).start()
    r_url = f"http://127.0.0.1:{router.port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as s:
            want = [(await _complete(s, d_url, q, 8, False))[0] for q in PROMPTS]  # colocated: D alone
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_first_token_then_rest(s, d_url, [7 + i, 8, 9], started[i]))
                       for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            conv: Any = ConvertRequest(16, 0.001, hand_back_ms=100.0).to_dict()
            async with s.post(f"{d_url}/kascade/v1/convert", json=conv, headers=auth) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["handBackMs"] == 100.0
            before = {u: await (await s.get(f"{u}/metrics")).text() for u in (p_url, d_url)}
            got = await asyncio.gather(*(_complete(s, r_url, q, 8, i % 2 == 0) for i, q in enumerate(PROMPTS)))
            running = [not t.done() for t in streams]
            after = {u: await (await s.get(f"{u}/metrics")).text() for u in (p_url, d_url, r_url)}
            counts = {b.pod: (b.in_flight, b.prefilling) for b in backends.values()}
            for t in streams:  # their work is done (they kept D busy through the burst): the clients leave
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            async with s.post(f"{d_url}/kascade/v1/convert", json={"prefillChunkTokens": None}, headers=auth) as r:
                assert r.status == 200
    finally:
        await router.close()

    def delta(u: str, name: str) -> float:
        return _metric(after[u], name) - _metric(before[u], name)

    assert [t for t, _ in got] == want
    assert all(h["X-Kascade-Replica"] == "tiny-llama-0" for _, h in got)  # the answers stream from D
    # D's hand-backs included: the router names P on every answer (without the hand-back header D took some
    # prompts "locally" as far as the router knew)
    assert [h.get("X-Kascade-Prefilled-By") for _, h in got] == ["tiny-llama-1"] * len(PROMPTS)
    handed = delta(d_url, "kascade_pd_handbacks_total")
    assert handed >= 1, "the router gave the converted decoder no prompt to prefill itself"
    assert _metric(after[r_url], "kascade_router_prefill_handbacks_total") == handed
    assert counts == {"tiny-llama-0": (0, 0), "tiny-llama-1": (0, 0)}  # the moved accounting was given back
    assert delta(p_url, "kascade_pd_prefills_served_total") == len(PROMPTS)  # the handed-back ones too
    assert delta(d_url, "kascade_pd_remote_prefills_total") == len(PROMPTS)
    assert delta(d_url, "kascade_pd_local_fallbacks_total") == 0
    assert all(running), "D's streams ended before the burst was answered: no prompt was stranded"
