"""Non-streamed answers through the router end when the engine's answer does, on REAL engine processes in PD (a
decode engine D, a prefill engine P on an emulated accelerator, as bench/pd.py runs them): a wave of concurrent
first requests on fresh engines, then sequential ones, every one well under the 10 s that a stall took.

The stall (ADR 0015): the router's engine client (kascade_router.upstream) kept body bytes that
arrived after the handler began `Answer.read()` unparsed, waiting for a read or relay that had already begun. The
answer then ended only when D closed the idle keep-alive connection at its 10 s header timeout (httpguard), and
the client saw 10.1-10.4 s instead of 0.1-0.5 s: 3-7 of 27 requests per run, with and without emulation, PD or
colocated. Whether a body comes after the head is timing (uvicorn writes them apart), so this test sends enough
requests that a run without the fix passes only by chance (~1 %); test_upstream.py has the deterministic case."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
from pdtrio import engine_procs, pd_routes

from kascade_devcluster.localengine import EngineProc
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.server import Router

TOKEN = "pd-no-stall-token"
WAVE, SEQUENTIAL = 7, 13
BOUND_S = 3.0  # a request here takes 0.1-0.5 s; a stalled one took 10 s + that


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("nostall") / "tiny-llama", layers=4, hidden=64, vocab=512)
    with engine_procs(ckpt, TOKEN, 64, {"p": ["--emulate-layer-ms", "20", "--emulate-knee-tokens", "64"]},
                      names=("d", "p")) as procs:
        yield procs


async def test_concurrent_and_sequential_pd_answers_end_without_a_stall(engines: dict[str, EngineProc]) -> None:
    d, p = engines["d"], engines["p"]
    routes = pd_routes(d, p)
    router = await Router(routes=routes).start()
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    took: list[float] = []
    try:
        # a request that stalls fails here at BOUND_S, not after its 10 s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND_S)) as s:
            async def one(i: int) -> None:
                body = {"model": "tiny-llama", "prompt": [(7 * j + i) % 500 + 1 for j in range(40)], "max_tokens": 8,
                        "temperature": 0}
                t0 = time.monotonic()
                async with s.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    doc = await r.json()
                    assert r.headers.get("X-Kascade-Prefilled-By") == "tiny-llama-1"  # P prefilled it (PD)
                took.append(time.monotonic() - t0)
                assert doc["usage"]["completion_tokens"] == 8

            await asyncio.gather(*(one(i) for i in range(WAVE)))  # first requests on fresh engines, at once
            for i in range(SEQUENTIAL):
                await one(WAVE + i)
    finally:
        await router.close()
    assert len(took) == WAVE + SEQUENTIAL and max(took) < BOUND_S, sorted(took)
