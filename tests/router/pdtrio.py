"""Real engine processes for the router's disaggregated tests, and the router's static table for them.

- `engine_procs`: engines of one tiny checkpoint by name, each with its own extra flags, stopped on exit;
- `pd_routes`: a decoder D and a prefill engine P (test_pd_answers_without_stalls, test_pd_emulated_knee,
  test_pd_prefill_capacity);
- the hand-back tests' three (test_router_handback_served, test_router_handback_accounting): D1 decodes, D2 is a
  converted decoder busy with four long streams (a step budget its decodes alone exceed, so it declines prompts
  on arrival), P is a prefill engine; `trio_routes` names them tiny-llama-0 (D1), tiny-llama-1 (D2,
  convertible), tiny-llama-2 (P)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_planner.engine_api import ConvertRequest
from kascade_router.backends import Backend, Routes
from kascade_router.server import static_routes

PROMPT = [(7 * j) % 500 + 1 for j in range(40)]
STREAM_TOKENS = 480


@contextmanager
def engine_procs(ckpt: Path, token: str, batch: int, extra: Mapping[str, Sequence[str]],
                 names: Sequence[str] = ("d1", "d2", "p"), kv_tokens: int = 8192) -> Iterator[dict[str, EngineProc]]:
    """Engines `names` of `ckpt` (model tiny-llama), each with its `extra` flags; stopped on exit."""
    procs: dict[str, EngineProc] = {}
    try:
        for name in names:
            procs[name] = start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens",
                                        str(kv_tokens), "--max-batch-tokens", str(batch), *extra.get(name, ())], token)
        yield procs
    finally:
        for e in procs.values():
            e.stop()


def pd_routes(d: EngineProc, p: EngineProc) -> Routes:
    """The router's table: D decodes, P prefills."""
    return static_routes([f"tiny-llama=decode@127.0.0.1:{d.http}+127.0.0.1:{d.act},"
                          f"prefill@127.0.0.1:{p.http}+127.0.0.1:{p.act}"])


def trio_routes(engines: Mapping[str, EngineProc]) -> tuple[Routes, Backend, Backend, Backend]:
    """The router's table: D1 and D2 decode, P prefills; D2 convertible (the pod annotation's effect)."""
    d1, d2, p = engines["d1"], engines["d2"], engines["p"]
    routes = static_routes([f"tiny-llama=decode@127.0.0.1:{d1.http}+127.0.0.1:{d1.act},"
                            f"decode@127.0.0.1:{d2.http}+127.0.0.1:{d2.act},"
                            f"prefill@127.0.0.1:{p.http}+127.0.0.1:{p.act}"])
    (backends,) = routes.backends.values()
    b_d1, b_d2, b_p = (backends[f"tiny-llama-{i}"] for i in range(3))
    b_d2.convertible = True  # what the pod annotation kascade.io/convertible does
    return routes, b_d1, b_d2, b_p


async def _stream(s: aiohttp.ClientSession, url: str, prompt: list[int], started: asyncio.Event) -> None:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
    async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                started.set()


async def convert_beside_streams(s: aiohttp.ClientSession, d2_url: str, token: str) -> list[asyncio.Task[None]]:
    """Four long streams on D2, then D2 converted (16-token chunks, a 1 ms step budget, a 100 ms hand-back bound);
    the streams' tasks (cancel them at the end)."""
    started = [asyncio.Event() for _ in range(4)]
    streams = [asyncio.create_task(_stream(s, d2_url, [7 + i, 8, 9], started[i])) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    conv = ConvertRequest(16, 0.001, hand_back_ms=100.0).to_dict()
    async with s.post(f"{d2_url}/kascade/v1/convert", json=conv, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200, await r.text()
    return streams


async def end_streams(
    s: aiohttp.ClientSession, d2_url: str, token: str, streams: list[asyncio.Task[None]]
) -> list[bool]:
    """Which of D2's streams still ran (each should: a D2 with no decodes keeps prompts); then cancels them and
    takes D2's conversion back."""
    running = [not t.done() for t in streams]
    for t in streams:
        t.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    async with s.post(
        f"{d2_url}/kascade/v1/convert", json={"prefillChunkTokens": None}, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        assert r.status == 200
    return running
