"""An emulated accelerator's knee (`--emulate-knee-tokens`) applies on a prefill engine's KV-shipping forward too, on
REAL engine processes through the router: past the knee a layer forward costs in proportion to its tokens, as in
every other step (`cooperation.staggered`), so bench/pd.py's emulated prefill engine is not ~tokens/knee times
faster than its own calibration. A 64-token prompt at an 8-token knee, 4 layers x 20 ms: at least 4 x 20 x 8 =
640 ms on P (one layer time per layer, 80 ms, without the knee)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
import pytest
from pdtrio import engine_procs, pd_routes

from kascade_devcluster.localengine import EngineProc
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.server import Router

TOKEN = "pd-knee-token"
PROMPT = [(11 * j) % 500 + 1 for j in range(64)]
LAYERS, LAYER_MS, KNEE = 4, 20, 8


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("knee") / "tiny-llama", layers=LAYERS, hidden=64, vocab=512)
    with engine_procs(ckpt, TOKEN, 64, {"p": ["--emulate-layer-ms", str(LAYER_MS), "--emulate-knee-tokens", str(KNEE)]},
                      names=("d", "p"), kv_tokens=4096) as procs:
        yield procs


async def test_a_prefill_engine_shipping_kv_charges_the_knee(engines: dict[str, EngineProc]) -> None:
    d, p = engines["d"], engines["p"]
    routes = pd_routes(d, p)
    router = await Router(routes=routes).start()
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as s:
            took = []
            for _ in range(2):
                t0 = time.perf_counter()
                async with s.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=60)) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers.get("X-Kascade-Prefilled-By") == "tiny-llama-1"  # P prefilled it, shipping KV
                took.append(time.perf_counter() - t0)
    finally:
        await router.close()
    floor = LAYERS * LAYER_MS / 1e3 * len(PROMPT) / KNEE
    assert min(took) >= floor, (took, floor)
