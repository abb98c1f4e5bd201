"""Pacing of the data plane: the token bucket's arithmetic, a paced TCP connection over loopback that really
sends no faster than its cap (a lower bound on time, so a slow machine cannot fail it), and serving traffic
(KV frames) charged to the same bucket: it never waits, and the weights after it wait for its bytes too."""

from __future__ import annotations

import asyncio
import time

import pytest

from kascade_engine.net.pacing import PacedTransport, TokenBucket, egress_bucket, paced
from kascade_engine.net.transport import Connection
from kascade_engine.net.transport_tcp import TcpTransport


def test_bucket_allows_burst_then_paces_at_rate() -> None:
    now = [0.0]
    b = TokenBucket(1000.0, burst=500, clock=lambda: now[0])
    assert b.delay(500) == 0.0  # the burst goes at once
    assert b.delay(250) == pytest.approx(0.25)  # then 1000 B/s
    now[0] = 1.0  # a second later 1000 tokens were added to -250
    assert b.delay(250) == 0.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBucket(0, 10)


def test_a_charge_never_waits_and_later_takes_wait_for_it() -> None:
    now = [0.0]
    b = TokenBucket(1000.0, burst=500, clock=lambda: now[0])
    b.charge(500)  # the burst
    b.charge(1000)  # in debt: serving traffic went anyway
    assert b.delay(100) == pytest.approx(1.1)  # the weights after it wait for all 1100 bytes past the burst


def test_no_cap_means_the_plain_transport() -> None:
    t = TcpTransport()
    assert paced(t, None) is t and paced(t, 0) is t
    assert isinstance(paced(t, 1e6), PacedTransport)


@pytest.mark.parametrize("kv_mib", [0, 2], ids=["weights-alone", "kv-charged"])
def test_paced_tcp_sends_no_faster_than_the_cap(kv_mib: int) -> None:
    """6 MiB of weights at 8 MiB/s (1 MiB burst) take >= 5/8 s; with 2 MiB of KV charged to the same bucket
    while they go, >= 7/8 s: weights + KV stay within the cap (without the charge they finish in ~0.63 s)."""

    async def main() -> tuple[float, bytes]:
        got = bytearray()
        done = asyncio.Event()

        async def handler(conn: Connection) -> None:
            while len(got) < 6 << 20:
                _, payload = await conn.recv(timeout=10)
                got.extend(payload)
            done.set()

        rate = 8 << 20  # 8 MiB/s, burst 1 MiB: 6 MiB need >= 5/8 s
        bucket = egress_bucket(rate)
        assert bucket is not None and bucket.burst == 1 << 20
        tr = PacedTransport(TcpTransport(), bucket)
        listener = await tr.listen("127.0.0.1", 0, handler)
        conn = await tr.connect("127.0.0.1", listener.port)
        data = bytes(range(256)) * (4096 * 6)  # 6 MiB
        t0 = time.monotonic()
        for i in range(0, len(data), 1 << 20):
            if i == 2 << 20:
                for _ in range(kv_mib):  # a prefill engine's KV frames, sent at once on another connection
                    bucket.charge(1 << 20)
            await conn.send({"op": "chunk"}, memoryview(data)[i:i + (1 << 20)])
        await asyncio.wait_for(done.wait(), 30)
        dt = time.monotonic() - t0
        await conn.close()
        await listener.close()
        return dt, bytes(got)

    dt, got = asyncio.run(main())
    assert got == bytes(range(256)) * (4096 * 6)
    floor = (6 + kv_mib - 1) / 8 - 0.02
    assert dt >= floor, f"6 MiB of weights + {kv_mib} MiB of KV at 8 MiB/s (1 MiB burst) took only {dt:.3f} s"
