"""Pacing: a cap on how fast this engine SENDS on its data plane (`--transfer-max-mbps`), so background
weight transfers leave room on a shared NIC, and the KV caches a prefill engine ships count against the same
cap without waiting for it.

Data flow: the engine owns one `TokenBucket` (`egress_bucket`, EngineInstance.egress). `paced(transport,
bucket)` wraps the weight transport of every load plan; each `Connection` it hands out (connected or
accepted) passes payloads through that bucket before the inner `send`. KV frames (prefill_server.py) are
serving traffic: they go at once and `charge` the bucket, so the weights sent after them wait for their bytes
too: weights + KV stay within the cap, and KV never queues behind a weight transfer. Receiving is never
slowed here: the sender upstream paces its own link. Also what the end-to-end tests use to make a loopback
transfer last long enough to kill a peer in the middle.
"""

from __future__ import annotations

import asyncio
import time

from kascade_engine.net.transport import MAX_PAYLOAD, Connection, Handler, Header, Listener, Transport


class TokenBucket:
    """`rate` bytes per second with a burst of `burst` bytes; `take(n)` waits until n bytes are allowed."""

    def __init__(self, rate: float, burst: int, clock: object = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate, self.burst = float(rate), max(1, burst)
        self._clock = clock
        self._tokens, self._t = float(self.burst), self._now()
        self._lock = asyncio.Lock()

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator,no-any-return]

    def delay(self, n: int) -> float:
        """Seconds to wait before `n` more bytes may go (and reserve them)."""
        now = self._now()
        self._tokens = min(float(self.burst), self._tokens + (now - self._t) * self.rate)
        self._t = now
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)

    def charge(self, n: int) -> None:
        """`n` bytes that went already (serving traffic: never waits): later `take`s wait for them."""
        self.delay(n)

    async def take(self, n: int) -> None:
        async with self._lock:  # FIFO among senders: one long chunk cannot be overtaken forever
            wait = self.delay(n)
            if wait > 0:
                await asyncio.sleep(wait)


class PacedConnection:
    def __init__(self, inner: Connection, bucket: TokenBucket) -> None:
        self.inner, self.bucket = inner, bucket
        self.peer, self.local = inner.peer, inner.local

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"",
                   timeout: float | None = None) -> None:
        if len(payload):
            await self.bucket.take(len(payload))  # (waiting for our own cap is not the peer's stall)
        await self.inner.send(header, payload, timeout)

    async def recv(self, timeout: float | None = None, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytearray]:
        return await self.inner.recv(timeout, max_payload)

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        return await self.inner.recv_header(timeout)

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        await self.inner.recv_into(view, timeout)

    async def close(self) -> None:
        await self.inner.close()

    async def abort(self) -> None:
        await self.inner.abort()

    def admit(self) -> None:
        """Passes peerauth's admission to the listener's connection (else it stays an evictable stranger)."""
        admit = getattr(self.inner, "admit", None)
        if admit is not None:
            admit()


def egress_bucket(bytes_per_s: float | None) -> TokenBucket | None:
    """The engine's one egress budget (None: no cap). Burst: 1 MiB or 50 ms at the rate, the larger."""
    return TokenBucket(bytes_per_s, burst=max(1 << 20, int(bytes_per_s / 20))) if bytes_per_s else None


class PacedTransport:
    def __init__(self, inner: Transport, bucket: TokenBucket) -> None:
        self.inner = inner
        self.traffic = inner.traffic  # the inner transport's connections count what they carry
        self.hash_on_landing = inner.hash_on_landing  # reads still land on the caller's thread
        self.bucket = bucket  # the engine's one egress bucket (EngineInstance.egress)
        self.name = f"{inner.name}(paced {self.bucket.rate * 8 / 1e6:.0f} Mbit/s)"

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        async def wrapped(conn: Connection) -> None:
            await handler(PacedConnection(conn, self.bucket))

        return await self.inner.listen(host, port, wrapped)

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        return PacedConnection(await self.inner.connect(host, port, timeout), self.bucket)


def paced(transport: Transport, bucket: TokenBucket | float | None) -> Transport:
    """`transport` itself when there is no cap (None or 0), else a paced wrapper: on `bucket`, or on a bucket of
    its own for a rate in bytes/s (a test, a tool)."""
    own = bucket if isinstance(bucket, TokenBucket) else egress_bucket(bucket)
    return PacedTransport(transport, own) if own is not None else transport
