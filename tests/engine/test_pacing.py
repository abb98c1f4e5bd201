"""Pacing of weight data: the token bucket's arithmetic, and a paced TCP connection over loopback
that really sends no faster than its cap (a lower bound on time, so a slow machine cannot fail it)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kascade_engine.pacing import PacedTransport, TokenBucket, paced
from kascade_engine.transport import Connection
from kascade_engine.transport_tcp import TcpTransport


def test_bucket_allows_burst_then_paces_at_rate() -> None:
    now = [0.0]
    b = TokenBucket(1000.0, burst=500, clock=lambda: now[0])
    assert b.delay(500) == 0.0  # the burst goes at once
    assert b.delay(250) == pytest.approx(0.25)  # then 1000 B/s
    now[0] = 1.0  # a second later 1000 tokens were added to -250
    assert b.delay(250) == 0.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBucket(0, 10)


def test_no_cap_means_the_plain_transport() -> None:
    t = TcpTransport()
    assert paced(t, None) is t and paced(t, 0) is t
    assert isinstance(paced(t, 1e6), PacedTransport)


def test_paced_tcp_sends_no_faster_than_the_cap() -> None:
    async def main() -> tuple[float, bytes]:
        got = bytearray()
        done = asyncio.Event()

        async def handler(conn: Connection) -> None:
            while len(got) < 6 << 20:
                _, payload = await conn.recv(timeout=10)
                got.extend(payload)
            done.set()

        rate = 8 << 20  # 8 MiB/s, burst 1 MiB: 6 MiB need >= 5/8 s
        tr = PacedTransport(TcpTransport(), rate)
        listener = await tr.listen("127.0.0.1", 0, handler)
        conn = await tr.connect("127.0.0.1", listener.port)
        data = bytes(range(256)) * (4096 * 6)  # 6 MiB
        t0 = time.monotonic()
        for i in range(0, len(data), 1 << 20):
            await conn.send({"op": "chunk"}, memoryview(data)[i:i + (1 << 20)])
        await asyncio.wait_for(done.wait(), 30)
        dt = time.monotonic() - t0
        await conn.close()
        await listener.close()
        return dt, bytes(got)

    dt, got = asyncio.run(main())
    assert got == bytes(range(256)) * (4096 * 6)
    assert dt >= 0.6, f"6 MiB at 8 MiB/s (1 MiB burst) took only {dt:.3f} s"
