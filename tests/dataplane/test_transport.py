"""Transports under stress of the peer: one that stops reading, and UCX fast-path connections that
share a worker-address endpoint and close while the other's payload is in flight."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pytest

from kascade_engine.transport import Transport, TransportError
from kascade_engine.transport_tcp import TcpTransport


def _ucx(fast_path: bool) -> Any:
    try:
        from kascade_engine.transport_ucx import UcxTransport
    except ImportError as e:
        from kascade_devcluster.requirement import unavailable

        unavailable(f"ucxx not importable: {e}")
    return UcxTransport(fast_path=fast_path)


def _transport(name: str) -> Transport:
    return TcpTransport() if name == "tcp" else _ucx(fast_path=name == "ucx-fast")


@pytest.mark.parametrize("name", ["tcp", "ucx", "ucx-fast"])
async def test_a_peer_that_reads_nothing_fails_the_send_at_its_timeout(name: str) -> None:
    transport = _transport(name)
    headers: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    async def stalled(conn: Any) -> None:
        header, _ = await conn.recv_header(timeout=10)
        await headers.put(header)
        await asyncio.sleep(30)  # alive, never reads the payload

    listener = await transport.listen("127.0.0.1", 0, stalled)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"took nothing for 1\.0 s"):
            await conn.send({"op": "chunk", "n": 1}, bytes(64 << 20), timeout=1.0)  # more than any socket buffer
        assert 0.9 < time.monotonic() - t0 < 5
        assert (await asyncio.wait_for(headers.get(), 5))["n"] == 1
    finally:
        await conn.close()
        await listener.close()


async def test_ucx_fast_path_connections_share_one_endpoint_and_outlive_each_other() -> None:
    transport = _ucx(fast_path=True)
    from kascade_engine.transport_ucx import FAST_MIN

    received: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    first_closed = asyncio.Event()

    async def handler(conn: Any) -> None:
        header, plen = await conn.recv_header(timeout=10)
        if header["n"] == 2:
            await first_closed.wait()  # post this receive only once the other connection is gone
        buf = bytearray(plen)
        await conn.recv_into(memoryview(buf), timeout=10)
        await received.put((int(header["n"]), bytes(buf)))

    listener = await transport.listen("127.0.0.1", 0, handler)
    a = await transport.connect("127.0.0.1", listener.port)
    b = await transport.connect("127.0.0.1", listener.port)
    try:
        assert a.fast_ep is not None and a.fast_ep is b.fast_ep  # type: ignore[attr-defined]
        one, two = secrets.token_bytes(FAST_MIN * 8), secrets.token_bytes(FAST_MIN * 8)
        in_flight = asyncio.create_task(b.send({"op": "chunk", "n": 2}, two, timeout=10))
        await a.send({"op": "chunk", "n": 1}, one, timeout=10)
        assert await asyncio.wait_for(received.get(), 10) == (1, one)
        await a.close()
        await asyncio.sleep(0.2)  # the server side of `a` closes too
        first_closed.set()
        await asyncio.wait_for(in_flight, 10)
        assert await asyncio.wait_for(received.get(), 10) == (2, two)
    finally:
        await b.close()
        await listener.close()
