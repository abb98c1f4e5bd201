"""A prefill engine's reported prefill velocity is its CAPACITY (issue 18), on REAL engine processes through the
router: P on an emulated accelerator (4 layers x 40 ms a step up to its 64-token budget and knee: 400 tok/s when
full), a light load of short prompts, each alone in a step (10 tokens in 160 ms: 62.5 tok/s), then a burst of long
prompts that queue. The velocity the operator reads from P's /metrics (its own parser) is the best short step
before the burst and within 20 % of the burst's measured saturated throughput after it (the burst's prompt tokens
over P's prefill step seconds, from its step histogram). The old meter took every
step into its bucket's EWMA and the operator the min over buckets: it reported the short prompts' ~62 tok/s after
the burst too, ~6x under."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
from pdtrio import engine_procs, pd_routes
from prometheus_client.parser import text_string_to_metric_families

from kascade_devcluster.localengine import EngineProc
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_operator.metrics import parse_engine_metrics
from kascade_router.server import Router

TOKEN = "pd-capacity-token"
LAYERS, LAYER_MS, BUDGET = 4, 40, 64
FULL = BUDGET / (LAYERS * LAYER_MS / 1e3)  # 400 tok/s: a full step of the emulated accelerator
SHORT, LONG, BURST = 10, 200, 4  # light load: 10-token prompts one at a time; the burst: 4 x 200 tokens at once


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("cap") / "tiny-llama", layers=LAYERS, hidden=64, vocab=512)
    with engine_procs(ckpt, TOKEN, BUDGET, {"p": ["--emulate-layer-ms", str(LAYER_MS), "--emulate-knee-tokens",
                                                  str(BUDGET)]}, names=("d", "p"), kv_tokens=4096) as procs:
        yield procs


async def _velocity(s: aiohttp.ClientSession, e: EngineProc) -> tuple[float | None, float]:
    """(the prefill velocity the operator reads from the engine's /metrics, its prefill steps' seconds so far)."""
    async with s.get(f"{e.url}/metrics") as r:
        text = await r.text()
    v = parse_engine_metrics(text, time.time()).velocity
    busy = sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == "kascade_step_seconds_sum" and x.labels.get("kind") == "prefill")
    return None if v is None else v.prefill_tokens_per_s, busy


async def test_a_prefill_engines_velocity_is_its_saturated_throughput(engines: dict[str, EngineProc]) -> None:
    d, p = engines["d"], engines["p"]
    routes = pd_routes(d, p)
    router = await Router(routes=routes).start()
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def one(i: int, n: int) -> None:
                body = {"model": "tiny-llama", "prompt": [(7 * j + i) % 500 + 1 for j in range(n)], "max_tokens": 1,
                        "temperature": 0}
                async with s.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers.get("X-Kascade-Prefilled-By") == "tiny-llama-1"  # P prefilled it

            for i in range(3):
                await one(i, SHORT)
            light, busy0 = await _velocity(s, p)
            await asyncio.gather(*(one(10 + i, LONG) for i in range(BURST)))
            after, busy1 = await _velocity(s, p)
    finally:
        await router.close()
    # what P really prefilled per second of its burst steps (its last, partial step included): its saturated
    # throughput, timed by P itself (the client's wall time also holds the hops, the KV transfer and the decoder)
    measured = BURST * LONG / (busy1 - busy0)
    assert light is not None and light == pytest.approx(SHORT / (LAYERS * LAYER_MS / 1e3), rel=0.1)  # the floor
    assert after is not None and 0.8 * measured <= after <= 1.2 * measured, (after, measured, light)
    assert after <= FULL * 1.01  # never more than a full step of the emulated accelerator gives
