"""Issue 38 defect 7: the router's client-side guards on real sockets. A connection that sends no complete
request headers within the header timeout is closed (150 slow-header connections were still open after 90 s);
beyond the connection cap a new connection gets 503 + Retry-After and is closed while /healthz keeps answering
on the connections it has (20,400 idle connections exhausted the descriptors); refusals are logged at most once
per interval. The admin routes live on their own port when one is set."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.stubengine import StubEngine
from kascade_router.guard import RateLimitedLog
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    async def make(settings: RouterSettings) -> Router:
        eng = await StubEngine(name="e0").start()
        r = await Router(settings, static_routes([f"m={eng.address}"])).start()
        made.extend([r, eng])
        return r

    yield make
    for x in made:
        await x.close()


async def closed_within(r: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(r.read(), seconds) == b""
    except TimeoutError:
        return False


@pytest.mark.chaos
async def test_slow_header_connections_are_closed(router: Callable[..., Any]) -> None:
    r = await router(RouterSettings(header_timeout_s=0.5))
    conns = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(20)]
    for _, w in conns:
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        await w.drain()
    closed = await asyncio.gather(*(closed_within(rd, 3.0) for rd, _ in conns))
    assert all(closed), f"{closed.count(False)} of 20 slow-header connections still open"
    # an idle connection after an answer is closed at the same timeout
    rd, w = await asyncio.open_connection("127.0.0.1", r.port)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await rd.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await rd.readexactly(2)
    assert await closed_within(rd, 3.0)
    for _, w in conns:
        w.close()


@pytest.mark.chaos
async def test_connections_beyond_the_cap_get_503_and_health_still_answers(
        router: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    r = await router(RouterSettings(max_connections=10, retry_after_s=3))
    caplog.set_level(logging.WARNING, "kascade_router.guard")
    idle = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(10)]
    await asyncio.sleep(0.1)
    refused = []
    for _ in range(30):
        rd, w = await asyncio.open_connection("127.0.0.1", r.port)
        refused.append(await asyncio.wait_for(rd.read(), 3))
        w.close()
    assert all(x.startswith(b"HTTP/1.1 503") and b"Retry-After: 3" in x for x in refused), refused[0]
    lines = [rec for rec in caplog.records if "refusing a client connection" in rec.getMessage()]
    assert 1 <= len(lines) <= 2, f"{len(lines)} log lines for 30 refusals"
    rd, w = idle[0]  # a connection the router holds still works
    w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 3)).startswith(b"HTTP/1.1 200")
    for _, w in idle:
        w.close()
    await asyncio.sleep(0.2)  # the slots free up
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{r.port}/healthz") as resp:
        assert resp.status == 200


def test_rate_limited_log_counts_what_it_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    rl = RateLimitedLog(logging.getLogger("t"), every_s=3600)
    for i in range(100):
        rl.warning("refused %d", i)
    assert len(caplog.records) == 1 and rl.total == 100 and rl.count == 99


async def test_admin_routes_only_on_the_admin_port(router: Callable[..., Any]) -> None:
    r = await router(RouterSettings(admin_port=0))
    assert r.admin_port and r.admin_port != r.port
    async with aiohttp.ClientSession() as s:
        for path in ("/router/v1/routes", "/router/v1/demand", "/metrics"):
            async with s.get(f"http://127.0.0.1:{r.port}{path}") as resp:
                assert resp.status == 404, path  # engine addresses are not on the client port
            async with s.get(f"http://127.0.0.1:{r.admin_port}{path}") as resp:
                assert resp.status == 200, path
        async with s.get(f"http://127.0.0.1:{r.admin_port}/router/v1/routes") as resp:
            assert "127.0.0.1" in await resp.text()
        async with s.post(f"http://127.0.0.1:{r.admin_port}/v1/completions", json={"model": "m"}) as resp:
            assert resp.status in (404, 405)  # no OpenAI routes there


def test_guard_settings_are_checked() -> None:
    for bad in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"max_connections": 0},
                {"eject_after_failures": 0}, {"max_backend_connections": 0}, {"admin_port": 70000}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterSettings(**bad)  # type: ignore[arg-type]
