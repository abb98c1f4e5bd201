"""The outbound side of a transfer node: one queue and one writer per downstream flow, bounded
backpressure, and the source's feeders.

Data flow: a received chunk (or a source's resident block) -> `_forward_chunk`/`_forward` -> every
downstream flow that wants it -> `_put` into its `Downstream.queue` (at most `QUEUE_DEPTH` frames) ->
its `_writer` task -> `Connection.send`. When a queue is full the node waits for a slot, but a downstream
that keeps it waiting too long is dropped by name (`_drop`): it recovers from its fallbacks, this node
goes on. A mixin of `relay.TransferNode`, which owns the state declared below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kascade_engine.net import peerauth
from kascade_engine.net.transfer_spec import TransferSpec, shard_range
from kascade_engine.net.transport import (
    PREFIX,
    Connection,
    Header,
    Transport,
    TransportError,
    close_handshake,
)
from kascade_engine.weights.blocks import Block
from kascade_planner.plan import Flow, Plan

log = logging.getLogger(__name__)
QUEUE_DEPTH = 256  # frames queued per downstream (chunks are <= chunkBytes each)


@dataclass
class Downstream:
    flow: Flow
    queue: asyncio.Queue[tuple[Header, bytes | memoryview] | None] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_DEPTH))
    alive: bool = True
    waited_s: float = 0.0  # recent time this node waited for room in the queue (decays, see _put)
    decay_at: float = 0.0
    abort: bool = False  # reset the connection when dropped: what it has buffered is not worth reading
    writer: asyncio.Task[None] | None = None
    connected: bool = False  # its writer's connection is up and authenticated: only from then can it lag


class Forwarding:
    """Forwarding and backpressure of `relay.TransferNode` (state declared here, set in its __init__)."""

    spec: TransferSpec
    plan: Plan
    me: str
    transport: Transport
    is_source: bool
    faults: dict[str, Any]
    resident: dict[str, Block]
    downstream: list[Downstream]
    downstream_lost: dict[str, str]
    on_progress: Callable[[dict[str, Any]], None]

    def _wanted(self, d: Downstream, block: str, shard: tuple[int, int] | None, all_shards: bool) -> bool:
        if not d.alive or block not in d.flow.blocks:
            return False
        return all_shards or d.flow.shard is None or shard is None or d.flow.shard == shard

    async def _put(self, d: Downstream, item: tuple[Header, bytes | memoryview] | None, lag: bool = True) -> None:
        """Queue `item` for `d`, waiting for room. A downstream that takes nothing for `timeoutSeconds` (half
        that at a relay) is dropped; so is one that keeps a relay waiting more than half the time over the last
        `timeoutSeconds` (the relay's push upstream would otherwise be slowed to the laggard's pace). A
        source waits as long as its downstream makes progress: it always outruns its link; so does a
        relay forwarding a re-fetch (`lag=False`): a fallback pull is a burst, and slows no chain.
        A downstream not connected yet is not lagging: peers start concurrently, and its writer has
        `timeoutSeconds` to connect (`_connect_retrying`) and as long again to authenticate. Until then a
        full queue waits for it, and the lag rule's clock starts at the connection (a relay dropped a
        downstream that began listening 0.3 s after it as lagging, counting the time it was still dialling:
        the downstream re-fetched everything from a fallback). Past that budget it is dropped: by its
        writer when the connect fails, here where no writer runs."""
        if not d.alive:
            return
        if not d.queue.full():
            d.queue.put_nowait(item)
            return
        t_out = self.spec.timeout_s
        if not d.connected:
            try:
                async with asyncio.timeout(2 * t_out):
                    await d.queue.put(item)
            except TimeoutError:
                self._drop(d, f"lost: not connected within {2 * t_out:.1f} s")
            d.decay_at = time.monotonic()
            return
        relay = lag and not self.is_source
        now = time.monotonic()
        d.waited_s *= math.exp(-(now - d.decay_at) / t_out)  # recent waiting counts, old waiting fades
        d.decay_at = now
        stall = t_out if self.is_source else t_out / 2  # a relay must give up before its upstream does
        limit = min(stall, t_out / 2 - d.waited_s) if relay else stall
        try:
            async with asyncio.timeout(max(0.0, limit)):
                await d.queue.put(item)
        except TimeoutError:
            stalled = time.monotonic() - now
            why = (f"kept this relay waiting {d.waited_s + stalled:.1f} s of its last ~{t_out:.0f} s"
                   if relay and d.waited_s > 0.05 else f"took nothing for {stalled:.1f} s")
            self._drop(d, f"lagging: {why} with {QUEUE_DEPTH} frames queued", abort=True)
        finally:
            if relay:
                d.waited_s += time.monotonic() - now
            d.decay_at = time.monotonic()

    def _drop(self, d: Downstream, reason: str, abort: bool = False) -> None:
        """Stop sending to `d` (it re-fetches what it lacks from its fallbacks); this node goes on."""
        if not d.alive:
            return
        d.alive, d.abort = False, abort
        self.downstream_lost[d.flow.dst] = reason
        log.warning("%s: downstream %s dropped: %s", self.me, d.flow.dst, reason)
        self.on_progress({"event": "downstream-lost", "instance": self.me, "peer": d.flow.dst, "reason": reason})
        while not d.queue.empty():  # drop what it can no longer take
            d.queue.get_nowait()
        if d.writer is not None and d.writer is not asyncio.current_task():
            d.writer.cancel()

    def _drop_what_held_us_back(self) -> None:
        """This relay's upstream stream just failed while a downstream's backpressure was holding it back
        (that queue full, and this relay waited on it at least a quarter of the recent `timeoutSeconds`):
        most likely the upstream dropped this relay as lagging on that downstream's account. Drop that
        downstream too, as lagging: it re-fetches from its own fallbacks at their pace. Kept, it would be
        fed this relay's re-fetch at its own slow pace, with no lag rule to end it (a re-fetch is forwarded
        without one): throttle-middle-ucx took 44 s against a 14 s bound when the relay above the slow one
        won the race to drop first (ADR 0005). If the upstream really died instead,
        the cost is one more pull from a fallback."""
        if self.is_source:
            return
        t_out = self.spec.timeout_s
        now = time.monotonic()
        for d in self.downstream:
            recent = d.waited_s * math.exp(-(now - d.decay_at) / t_out)
            if d.alive and d.queue.full() and recent >= t_out / 4:
                self._drop(d, f"lagging: held this relay back {recent:.1f} s of its last ~{t_out:.0f} s as its "
                              f"upstream stream failed (re-fetch it from a fallback, not at this pace)", abort=True)

    async def _forward_chunk(self, header: Header, payload: bytes | bytearray | memoryview, block: str,
                             shard: tuple[int, int] | None, lag: bool = True) -> None:
        for d in self.downstream:
            if self._wanted(d, block, shard, False):
                lo, hi = shard_range(int(self.spec.manifest[block]["bytes"]), d.flow.shard)
                off = int(header.get("offset", 0))
                a, b = max(lo, off), min(hi, off + len(payload))
                if a < b:  # only the part of this chunk inside the downstream's shard
                    await self._put(d, ({**header, "offset": a, "shard": list(d.flow.shard) if d.flow.shard else None},
                                        memoryview(payload)[a - off:b - off]), lag)

    async def _forward(self, header: Header, payload: bytes, block: str, shard: tuple[int, int] | None,
                       all_shards: bool = False) -> None:
        for d in self.downstream:
            if self._wanted(d, block, shard, all_shards):
                await self._put(d, ({**header, "shard": list(d.flow.shard) if d.flow.shard else None}, payload))

    async def _feed_from_resident(self, d: Downstream) -> None:
        """A source sends its blocks in the flow's order, chunk by chunk, each followed by a commit."""
        for block in d.flow.blocks:
            data = self.resident[block].data
            lo, hi = shard_range(len(data), d.flow.shard)
            shard = list(d.flow.shard) if d.flow.shard else None
            for off in range(lo, hi, self.spec.chunk_bytes):
                chunk = data[off:min(hi, off + self.spec.chunk_bytes)]
                await self._put(d, ({"op": "chunk", "block": block, "shard": shard, "offset": off}, chunk))
                if not d.alive:
                    return  # dropped: it re-fetches from its fallbacks
            await self._put(d, ({"op": "commit", "block": block, "shard": shard}, b""))

    async def _writer(self, d: Downstream) -> None:
        host, port = self.spec.peers[d.flow.dst]
        rate = float(self.faults.get("rateMBps", 0)) * 1e6
        conn: Connection | None = None
        sent = 0
        try:
            conn = await self._connect_retrying(host, port)
            await peerauth.join(conn, self.spec.token, "transfer", self.spec.timeout_s, **{
                "from": self.me, "role": "push", "shard": list(d.flow.shard) if d.flow.shard else None,
                "flow": self.plan.flows.index(d.flow)})
            d.connected = True
            while (item := await d.queue.get()) is not None:
                header, payload = item
                t0 = time.monotonic()
                sent += len(payload)
                await self._send_faulty(conn, header, payload, sent)
                if rate and len(payload):  # test-only throttle to make transfers observable
                    await asyncio.sleep(max(0.0, len(payload) / rate - (time.monotonic() - t0)))
            await conn.send({"op": "end"}, timeout=self.spec.timeout_s)
            await close_handshake(conn, self.spec.timeout_s, sent_end=True)
        except (TransportError, ValueError, TypeError) as e:
            self._drop(d, f"lost: {e}")
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await (conn.abort() if d.abort else conn.close())

    async def _send_faulty(self, conn: Connection, header: Header, payload: bytes | memoryview, sent: int) -> None:
        """`conn.send`, except for test-only faults of this (source) node: cut or desync its stream."""
        f = self.faults
        if f and "cutAfterBytes" in f and sent > int(f["cutAfterBytes"]) and not f.get("_cut"):
            f["_cut"] = True
            await conn.close()
            raise TransportError("fault injection: outbound connection cut")
        if f and "desyncAfterBytes" in f and sent > int(f["desyncAfterBytes"]) and not f.get("_desync") \
                and header.get("op") == "chunk" and int(header.get("offset", 0)) >= PREFIX.size:
            f["_desync"] = True  # a chunk shifted from its place: the receiver's digest must catch it
            header = {**header, "offset": int(header["offset"]) - PREFIX.size}
        await conn.send(header, payload, timeout=self.spec.timeout_s)

    async def _connect_retrying(self, host: str, port: int) -> Connection:
        """Peers start concurrently: retry until the timeout before declaring the peer dead."""
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            try:
                return await self.transport.connect(host, port, timeout=self.spec.timeout_s)
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
