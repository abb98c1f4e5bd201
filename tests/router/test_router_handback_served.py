"""A converted decoder prefilling for ANOTHER decoder hands the prompt to a prefill engine, through the router, on
REAL engine processes (a tiny random Llama on CPU).

- D1 decodes (not converted), D2 is a converted decoder busy with four long streams and a step budget its decodes
  alone exceed (its measured prefill rate is 0, or not measured yet), P is a prefill engine;
- the router's table makes D1 the decoder and D2 the prefill candidate (P counted busy), so it sends D1 the
  request with `X-Kascade-Prefill: D2` and names P in `X-Kascade-Prefill-Fallback` (`balancer.fallback_prefill`);
- D2 declines the prompt on arrival (`conversion.arrival_verdict`), D1 passes it to the fallback it was given,
  and P prefills it: the answer equals the colocated one, P served it, D1 prefilled nothing itself.
Fails without the router's fallback for a converted `pre`: D1 prefills the handed-back prompt itself (P serves 0)."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from pdtrio import PROMPT, convert_beside_streams, end_streams, engine_procs, trio_routes
from prometheus_client.parser import text_string_to_metric_families

from kascade_devcluster.localengine import EngineProc
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.server import Router

TOKEN = "router-handback-served-token"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("served") / "tiny-llama", layers=4, hidden=64, vocab=512)
    # D2's steps take >= 32 ms (an emulated accelerator): its streams outlast the request on a loaded machine
    with engine_procs(ckpt, TOKEN, 32, {"d2": ["--emulate-layer-ms", "8"]}) as procs:
        yield procs


def _metric(text: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def test_a_prompt_a_converted_decoder_declines_for_another_decoder_goes_to_the_prefill_engine(
        engines: dict[str, EngineProc]) -> None:
    urls = {n: f"http://127.0.0.1:{e.http}" for n, e in engines.items()}
    routes, b_d1, b_d2, b_p = trio_routes(engines)
    # the table's counts make the choice deterministic: D2 streams much (D1 decodes), P prefills much (D2 prefills)
    b_d2.in_flight, b_p.in_flight = 50, 50
    router = await Router(routes=routes).start()
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{urls['d1']}/v1/completions", json=body) as r:  # colocated reference: D1 alone
                want = (await r.json())["choices"][0]["text"]
            streams = await convert_beside_streams(s, urls["d2"], TOKEN)
            before = {n: await (await s.get(f"{u}/metrics")).text() for n, u in urls.items()}
            async with s.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=120)) as r:
                assert r.status == 200, await r.text()
                got, headers = (await r.json())["choices"][0]["text"], dict(r.headers)
            after = {n: await (await s.get(f"{u}/metrics")).text() for n, u in urls.items()}
            running = await end_streams(s, urls["d2"], TOKEN, streams)
    finally:
        await router.close()

    def delta(n: str, name: str) -> float:
        return _metric(after[n], name) - _metric(before[n], name)

    assert got == want
    assert headers["X-Kascade-Replica"] == "tiny-llama-0"  # D1 decoded it
    assert headers.get("X-Kascade-Prefilled-By") == "tiny-llama-2"  # P prefilled it (D1 said so: X-Kascade-Handed-Back)
    assert all(running), "D2's streams ended first: it had no decodes, and the arrival rule keeps such a prompt"
    assert delta("d2", "kascade_pd_handbacks_total") == 1  # D2 declined it
    assert delta("p", "kascade_pd_prefills_served_total") == 1  # ... and P prefilled it, as the router named
    assert delta("d1", "kascade_pd_remote_prefills_total") == 1  # its KV came to D1 from P
    assert delta("d1", "kascade_pd_local_fallbacks_total") == 0
    assert (b_d1.in_flight, b_d2.in_flight, b_p.in_flight) == (0, 50, 50)  # the router's accounting given back
