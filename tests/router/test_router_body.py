"""Issue 38 defect 1: the router reads the whole request body, however it arrives (several writes apart, many
small pieces, after `Expect: 100-continue`, chunked), before it parses it; a chunked body over the limit gets
413, a body not complete in time 408, a deeply nested one a JSON 400. Raw sockets on the client side (an HTTP
client library writes a body at once), a real router, stub engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kascade_devcluster.stubengine import StubEngine
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    async def make(settings: RouterSettings | None = None) -> tuple[Router, StubEngine]:
        eng = await StubEngine(name="e0").start()
        r = await Router(settings or RouterSettings(hold_timeout_s=2.0), static_routes([f"m={eng.address}"])).start()
        made.extend([r, eng])
        return r, eng

    yield make
    for x in made:
        await x.close()


async def send_raw(port: int, head: bytes, pieces: list[bytes], gap_s: float = 0.0,
                   wait_continue: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Write `head` then each piece `gap_s` apart on one connection; the response's status, headers, body."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(head)
        await w.drain()
        if wait_continue:
            line = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert line.startswith(b"HTTP/1.1 100"), line
        for p in pieces:
            if gap_s:
                await asyncio.sleep(gap_s)
            w.write(p)
            await w.drain()
        status_head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        lines = status_head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(r.readexactly(n), 10) if n else b""
        return int(lines[0].split()[1]), headers, body
    finally:
        w.close()


def _head(length: int | None, extra: str = "") -> bytes:
    framing = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}{extra}"
            "\r\n").encode()


BODY = json.dumps({"model": "m", "prompt": "hello there"}).encode()


@pytest.mark.chaos
async def test_a_body_in_two_writes_50ms_apart_is_read_whole(router: Callable[..., Any]) -> None:
    r, eng = await router()
    half = len(BODY) // 2
    st, _, body = await send_raw(r.port, _head(len(BODY)), [BODY[:half], BODY[half:]], gap_s=0.05)
    assert st == 200, body
    assert len(eng.seen) == 1


@pytest.mark.chaos
async def test_a_200kb_body_in_16kb_pieces_is_read_whole(router: Callable[..., Any]) -> None:
    r, eng = await router()
    big = json.dumps({"model": "m", "prompt": "x" * (200 << 10)}).encode()
    pieces = [big[i:i + (16 << 10)] for i in range(0, len(big), 16 << 10)]
    st, _, body = await send_raw(r.port, _head(len(big)), pieces, gap_s=0.005)
    assert st == 200, body
    assert len(eng.seen) == 1


async def test_expect_100_continue_is_answered_and_the_body_read(router: Callable[..., Any]) -> None:
    r, eng = await router()
    st, _, body = await send_raw(r.port, _head(len(BODY), "Expect: 100-continue\r\n"), [BODY[:5], BODY[5:]],
                                 gap_s=0.05, wait_continue=True)
    assert st == 200, body
    assert len(eng.seen) == 1


def _chunks(data: bytes, size: int) -> list[bytes]:
    out = [b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size)]
    return [*out, b"0\r\n\r\n"]


async def test_a_chunked_body_is_read_whole(router: Callable[..., Any]) -> None:
    r, eng = await router()
    st, _, body = await send_raw(r.port, _head(None), _chunks(BODY, 7), gap_s=0.01)
    assert st == 200, body
    assert len(eng.seen) == 1


async def test_a_chunked_body_over_the_limit_gets_413(router: Callable[..., Any]) -> None:
    r, eng = await router(RouterSettings(hold_timeout_s=2.0, max_body_bytes=1000))
    big = json.dumps({"model": "m", "prompt": "x" * 5000}).encode()
    st, _, body = await send_raw(r.port, _head(None), _chunks(big, 512), gap_s=0.005)
    assert st == 413, body
    assert "1000" in json.loads(body)["error"]["message"]
    assert eng.seen == []


@pytest.mark.chaos
async def test_a_body_not_complete_in_time_gets_408(router: Callable[..., Any]) -> None:
    r, eng = await router(RouterSettings(hold_timeout_s=2.0, body_timeout_s=0.3))
    st, _, body = await send_raw(r.port, _head(len(BODY)), [BODY[:10]])
    assert st == 408, body
    assert "0.3" in json.loads(body)["error"]["message"] and eng.seen == []


async def test_deeply_nested_json_gets_a_json_400(router: Callable[..., Any]) -> None:
    r, eng = await router()
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    st, h, body = await send_raw(r.port, _head(len(deep)), [deep])
    assert st == 400 and h["content-type"].startswith("application/json"), body
    assert "nested" in json.loads(body)["error"]["message"]
    assert eng.seen == []
