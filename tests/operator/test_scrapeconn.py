"""The sweep's lean GET (scrapeconn.py) against a hand-written HTTP/1.1 server: Content-Length and chunked
bodies, a kept-alive connection reused, one the server closed reopened once, `Connection: close` answered,
a silent server timing out, a non-HTTP answer refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kascade_operator.scrapeconn import ScrapeConns, ScrapeError

ANSWERS = {
    b"/len": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
    b"/close": b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy",
    b"/junk": b"SSH-2.0-OpenSSH\r\n\r\n",
}


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[int]]]:
    conns: list[int] = []  # one entry per accepted connection

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                if path == b"/silent":
                    await asyncio.sleep(5)
                writer.write(ANSWERS[path])
                await writer.drain()
                if path in (b"/close", b"/len-then-close"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"127.0.0.1:{port}", conns


async def test_bodies_by_length_and_chunks_over_one_kept_alive_connection(server: tuple[str, list[int]]) -> None:
    ep, conns = server
    c = ScrapeConns(2.0)
    assert await c.get(ep, "/len") == (200, "hello")
    assert await c.get(ep, "/chunked") == (200, "abcde")
    assert await c.get(ep, "/len") == (200, "hello")
    assert len(conns) == 1  # kept alive
    assert await c.get(ep, "/close") == (503, "busy")  # answered; the connection is not kept
    assert await c.get(ep, "/len") == (200, "hello")
    assert len(conns) == 2
    await c.aclose()


async def test_a_connection_the_server_dropped_is_reopened_once_and_errors_say_what(
        server: tuple[str, list[int]]) -> None:
    ep, conns = server
    c = ScrapeConns(0.5)
    assert await c.get(ep, "/len") == (200, "hello")
    conn = c._conns[ep]
    assert conn.writer is not None
    conn.writer.transport.abort()  # as if the engine restarted between scrapes: the next GET reopens
    await asyncio.sleep(0.05)
    assert await c.get(ep, "/len") == (200, "hello")
    assert len(conns) == 2
    with pytest.raises(ScrapeError, match="TimeoutError"):
        await c.get(ep, "/silent")
    with pytest.raises(ScrapeError, match="not an HTTP"):
        await c.get(ep, "/junk")
    with pytest.raises(ScrapeError, match=r"ConnectionRefused|OSError|Errno"):
        await ScrapeConns(0.5).get("127.0.0.1:1", "/len")
    await c.aclose()
