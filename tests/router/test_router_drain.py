"""Issue 32: a router pod going away (a node drain, a rolling update) finishes the requests it holds. SIGTERM
(`kascade router` closes the Router on it) closes the listeners at once and gives streams in flight
`drain_s` to end; the chart delays SIGTERM with a preStop sleep so the Service stops sending new connections
first (tests/chart)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from kascade_devcluster.stubengine import StubEngine
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


async def stream_after_close(drain_s: float) -> tuple[int, bool, float]:
    """(tokens received, [DONE] seen, seconds the close took) for a 2 s stream whose router closes after the
    stream's first token."""
    eng = await StubEngine(name="e0", tokens=20, delay_s=0.1).start()
    r = await Router(RouterSettings(drain_s=drain_s), static_routes([f"m={eng.address}"])).start()
    closing: asyncio.Task[None] | None = None
    tokens, done = 0, False
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "hi", "max_tokens": 20, "stream": True}
            async with http.post(f"http://127.0.0.1:{r.port}/v1/completions", json=body) as resp:
                assert resp.status == 200
                try:
                    async for line in resp.content:
                        text = line.decode().strip()
                        if not text.startswith("data: "):
                            continue
                        if text == "data: [DONE]":
                            done = True
                            continue
                        json.loads(text[6:])
                        tokens += 1
                        if closing is None:  # SIGTERM now
                            t0 = time.monotonic()
                            closing = asyncio.create_task(r.close())
                            await asyncio.sleep(0.05)
                            with pytest.raises(OSError):  # the listener is closed: no new client
                                await asyncio.open_connection("127.0.0.1", r.port)
                except aiohttp.ClientPayloadError:
                    pass  # cut by the drain deadline
        assert closing is not None
        await asyncio.wait_for(closing, 30)
        return tokens, done, time.monotonic() - t0
    finally:
        await r.close()
        await eng.close()


async def test_a_stream_in_flight_finishes_after_sigterm() -> None:
    tokens, done, took = await stream_after_close(drain_s=30.0)
    assert tokens == 20 and done, f"{tokens} of 20 tokens, [DONE] {done}"
    assert took < 10.0  # the close returns once the stream ended, not after the whole drain time


async def test_the_drain_is_bounded() -> None:
    tokens, done, took = await stream_after_close(drain_s=0.5)
    assert tokens < 20 and not done
    assert took < 5.0
