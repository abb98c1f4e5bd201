"""Closing a TCP connection while a read or a send waits on it in the event loop.

The bug this guards (issue 17's re-formed-pipeline hang): closing the fd under a waiting read left the
loop's selector holding a registration that epoll had already dropped; the next socket given the same
fd number (the new pipeline hop) was never woken, or failed to connect with ENOENT. Close now shuts
the socket down, the waiter wakes with an error at once, and the fd is released only after it returns.
"""

from __future__ import annotations

import asyncio

import pytest

from kascade_engine.net.transport import Connection, TransportError
from kascade_engine.net.transport_tcp import TcpTransport


async def _echo(conn: Connection) -> None:
    while True:
        header, _ = await conn.recv()
        await conn.send({"op": "echo", "seen": header.get("op")})


async def test_close_under_a_waiting_read_wakes_it_and_the_next_connection_works() -> None:
    tr = TcpTransport()
    lst = await tr.listen("127.0.0.1", 0, _echo)
    try:
        old = await tr.connect("127.0.0.1", lst.port)
        waiting = asyncio.create_task(old.recv(timeout=60))
        while not old._busy:  # the read is parked in the event loop
            await asyncio.sleep(0.001)
        await old.close()
        assert old.closed
        # a new connection while the old read has not returned yet (the re-formed hop): it must work
        new = await tr.connect("127.0.0.1", lst.port)
        reply = asyncio.create_task(new.recv(timeout=60))
        await asyncio.sleep(0)  # the new read is parked before the data arrives
        await new.send({"op": "hi"})
        assert (await reply)[0] == {"op": "echo", "seen": "hi"}
        with pytest.raises(TransportError, match="closed"):  # woken by the close, not by its 60 s timeout
            await waiting
        with pytest.raises(TransportError):  # the old connection stays unusable
            await old.send({"op": "again"})
        await new.close()
    finally:
        await lst.close()


async def test_close_under_a_blocked_send_fails_it() -> None:
    tr = TcpTransport()
    hold = asyncio.Event()

    async def never_reads(conn: Connection) -> None:
        await hold.wait()

    lst = await tr.listen("127.0.0.1", 0, never_reads)
    try:
        conn = await tr.connect("127.0.0.1", lst.port)
        sending = asyncio.create_task(conn.send({"op": "big"}, bytes(64 << 20), timeout=60))  # > both buffers
        while not sending.done() and not conn._busy:  # parked: the kernel buffers are full
            await asyncio.sleep(0.001)
        assert not sending.done(), "64 MiB fit in the socket buffers: the send never blocked"
        await conn.close()
        with pytest.raises(TransportError, match="send to"):
            await sending
    finally:
        hold.set()
        await lst.close()
