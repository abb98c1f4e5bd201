"""One participant of a weight transfer: receive, verify, forward (cut-through), serve, recover.

Data flow (per node, one asyncio loop):
  upstream push / fallback pull --chunk--> block buffer --same chunk--> every downstream flow wanting it
                                                       +--> the block's verifier (blockverify.py): over TCP
                                                            hashed right here, still in this core's cache
  on upstream `commit`: when all shards of the block are in, the verifier finishes its digest and checks
  it against the manifest; good -> resident, `commit` downstream; bad -> `abort` downstream and re-fetch
  from a fallback source.
Downstream therefore may see a block's chunks early but only ever marks resident what it saw
committed: corrupt bytes never become resident anywhere. When an upstream dies (connection lost,
silent past the timeout, or never connects), whatever it had not committed is pulled from the
plan's fallback sources and forwarded on as usual, so the rest of the chain completes.
Backpressure is bounded: each downstream has a queue of `QUEUE_DEPTH` frames; when it is full the
node waits for a slot, but a downstream that keeps it waiting `timeoutSeconds` in all (or takes nothing
for half of it) is dropped, with its reason logged, reported as a `downstream-lost` event and listed in
the summary; it recovers from its fallbacks like any node whose upstream died, and this node keeps going.
Every task a node starts reports its failure: an unexpected error in a re-fetch, a verification or a
feeder ends `run()` with `TransferFailed` naming it (the engine shows it as the load error).
Every connection starts with `peerauth`'s mutual challenge–response over the plan token (which never
crosses the wire); before it succeeds nothing is allocated for a payload: its frames carry none, and a
frame announcing one is refused unread.
Protocol ops: challenge/hello/welcome/error (peerauth), chunk, commit, abort, end, pull.
Modules: this one receives, verifies and serves; `forwarding.py` is the outbound side (queues, writers,
backpressure, the source's feeders); `recovery.py` re-fetches from fallbacks and serves pulls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kascade_engine.net import peerauth
from kascade_engine.net.forwarding import Downstream, Forwarding
from kascade_engine.net.recovery import Recovery, Slot, TransferFailed
from kascade_engine.net.transfer_spec import TransferSpec, shard_range
from kascade_engine.net.transport import (
    PREFIX,
    Connection,
    Header,
    Listener,
    Transport,
    TransportError,
    close_handshake,
)
from kascade_engine.weights.arena import ReceiveArena
from kascade_engine.weights.blocks import Block, BlockSet, digest_matches, index_from_manifest
from kascade_engine.weights.blockverify import BlockVerifier
from kascade_planner.plan import Flow

log = logging.getLogger(__name__)


class TransferNode(Forwarding, Recovery):
    """One participant: receiving, verifying and serving live here; the outbound side is `Forwarding`
    (forwarding.py), re-fetching from fallbacks is `Recovery` (recovery.py)."""

    def __init__(self, spec: TransferSpec, me: str, transport: Transport, blocks: BlockSet | None = None,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spec, self.me, self.transport = spec, me, transport
        self.plan = spec.plan
        self.is_source = any(s.id == me for s in self.plan.sources)
        if self.is_source and blocks is None:
            raise ValueError(f"{me} is a source and needs its blocks")
        self.on_progress = on_progress or (lambda e: None)
        self.faults = dict(spec.faults.get(me, {}))
        self.inbound = self.plan.inbound(me)
        self.outbound = self.plan.outbound(me)
        self.buffers: dict[str, memoryview] = {}
        # Over a transport whose reads copy into place on this thread, a block's digest advances as its
        # chunks land (see _landed); otherwise the whole block is hashed once, at commit.
        self.verifiers: dict[str, BlockVerifier] = {}
        self.resident: dict[str, Block] = {}
        if blocks is not None:
            self.resident = dict(blocks.blocks)
        # Which slots each block arrives in (shard count), and which slots are complete.
        self.slot_count: dict[str, int] = {}
        for f in self.inbound:
            for b in f.blocks:
                self.slot_count[b] = f.shard[1] if f.shard else 1
        self.done_slots: dict[str, set[int | None]] = {}
        # Receive memory, reserved in the order blocks will arrive (the first inbound flow's order).
        order = list(dict.fromkeys(b for f in self.inbound for b in f.blocks))
        self.arena = ReceiveArena([] if self.is_source else [(b, int(spec.manifest[b]["bytes"])) for b in order])
        self.downstream = [Downstream(f) for f in self.outbound]
        self.all_resident = asyncio.Event()
        self.error: Exception | None = None
        self.listener: Listener | None = None
        self.bytes_in = 0
        self.refetches = 0
        self.max_refetch_per_block = 3  # a fallback serving a bad copy must not loop forever
        self._refetched: dict[str, int] = {}
        self.corrupt_detected = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.downstream_lost: dict[str, str] = {}  # peer -> why it was dropped
        self._connected: set[str] = set()
        self._refetching: set[Slot] = set()
        self.started = time.monotonic()
        self.first_byte_at: float | None = None  # wall clock, comparable across processes
        self.done_at: float | None = None
        if self.is_source or not self.inbound:
            self.all_resident.set()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> int:
        host, port = self.spec.peers.get(self.me, ("127.0.0.1", 0))
        self.arena.start()
        self.listener = await self.transport.listen(host, port, self._serve)
        if self.arena.order:
            self._spawn(self._report_reserved(), "arena report")
        return self.listener.port

    def _spawn(self, coro: Any, what: str) -> asyncio.Task[Any]:
        """A task of this node whose unexpected failure fails the transfer (never dies silently)."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)

        def done(t: asyncio.Task[Any]) -> None:
            if t.cancelled() or t.exception() is None:
                return
            e = t.exception()
            if not isinstance(e, TransferFailed):
                log.error("%s: %s failed: %r", self.me, what, e)
                e = TransferFailed(f"{self.me}: {what} failed: {type(e).__name__}: {e}")
            self._fail(e)

        task.add_done_callback(done)
        return task

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = e
        self.all_resident.set()  # wake run(), which raises

    async def _report_reserved(self) -> None:
        await asyncio.to_thread(self.arena.ready.wait)
        self.on_progress({"event": "reserved", "instance": self.me, "blocks": self.arena.populated,
                          "of": len(self.arena.order), "seconds": round(self.arena.populate_s, 4)})

    async def run(self) -> dict[str, Any]:
        """Push outbound flows, receive inbound ones; returns once everything here is resident and
        every downstream flow got every block committed (or its peer died)."""
        for d in self.downstream:
            d.writer = self._spawn(self._writer(d), f"writer to {d.flow.dst}")
        writers = [d.writer for d in self.downstream if d.writer is not None]
        if self.is_source and self.spec.not_before is not None:
            await asyncio.sleep(max(0.0, self.spec.not_before - time.time()))
        feeders = [self._spawn(self._feed_from_resident(d), f"feeder of {d.flow.dst}")
                   for d in self.downstream] if self.is_source else []
        if not self.is_source and self.inbound:
            self._spawn(self._watchdog(), "watchdog")
        await self.all_resident.wait()
        if self.error is None and feeders:
            await asyncio.wait(feeders)  # each ends: its downstream took everything or was dropped
        if self.error is None:
            for d in self.downstream:
                await self._put(d, None)  # end marker after everything queued
            if writers:
                await asyncio.wait(writers)
        if self.error is not None:
            raise TransferFailed(str(self.error))
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {"instance": self.me, "resident": len(self.resident), "blocks": len(self.plan.model.block_ids),
                "bytesReceived": self.bytes_in, "refetches": self.refetches, "corruptDetected": self.corrupt_detected,
                "blocksReservedAhead": self.arena.populated, "downstreamLost": dict(self.downstream_lost),
                "seconds": round(time.monotonic() - self.started, 4), "firstByteAt": self.first_byte_at,
                "doneAt": self.done_at}

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.listener:
            await self.listener.close()
        await asyncio.to_thread(self.arena.close)

    # -- serving connections -----------------------------------------------------------------------
    async def _serve(self, conn: Connection) -> None:
        try:
            # Challenge–response (peerauth): the plan token never crosses the wire, and the hello carries
            # no payload (one that announces any is refused before a byte of it is read).
            try:
                admitted = await peerauth.accept(conn, self.spec.token, "transfer", self.spec.timeout_s)
            except peerauth.AuthError:
                return
            hello = admitted.claims
            peer = str(hello.get("from", ""))
            role = hello.get("role")
            shard = tuple(hello["shard"]) if hello.get("shard") else None
            if role == "push" and any(f.src == peer and f.shard == shard for f in self.inbound):
                await conn.send(admitted.welcome.header(), timeout=self.spec.timeout_s)
                self._connected.add(peer)
                await self._consume(conn, peer, shard, flow=self._pushed_flow(hello, peer, shard))
            elif role == "pull" and peer in {i.id for i in (*self.plan.sources, *self.plan.targets)}:
                await conn.send(admitted.welcome.header(), timeout=self.spec.timeout_s)
                await self._serve_pull(conn)
            else:
                await conn.send(
                    {"op": "error", "message": f"{peer or '?'} is not a {role} peer of {self.me} in this plan"},
                    timeout=self.spec.timeout_s,
                )
                log.warning("%s: rejected %s from %r: not in the plan", self.me, role, peer)
        except (TransportError, KeyError, ValueError, TypeError) as e:
            log.warning("%s: connection %s failed: %s", self.me, conn.peer, e)

    def _pushed_flow(self, hello: Header, peer: str, shard: tuple[int, int] | None) -> Flow | None:
        """The plan flow a push stream carries (its hello names the index): a peer may send this node
        several flows with the same shard (striped plans: one per stripe), and each stream answers
        only for its own blocks. None for a hello without a valid index (then: all of them)."""
        k = hello.get("flow")
        flows = self.plan.flows
        if (
            isinstance(k, int)
            and 0 <= k < len(flows)
            and (flows[k].src, flows[k].dst, flows[k].shard) == (peer, self.me, shard)
        ):
            return flows[k]
        return None

    async def _consume(self, conn: Connection, peer: str, flow_shard: tuple[int, int] | None = None,
                       pull: bool = False, flow: Flow | None = None) -> bool:
        """Apply a stream of chunk/commit/abort/end from `peer` (its flow `flow_shard`, for pushes;
        `flow`: the one flow it carries, when known). Returns True on a clean end."""
        verifying: list[asyncio.Task[None]] = []
        try:
            while True:
                header, plen = await conn.recv_header(timeout=self.spec.timeout_s)
                op = header["op"]
                if op == "chunk" and plen:
                    view = self._chunk_target(str(header.get("block")), header, plen)
                    if self.first_byte_at is None:
                        self.first_byte_at = time.time()
                    await self._recv_payload(conn, view, pull)
                    await self._on_chunk(str(header["block"]), tuple(header["shard"]) if header.get("shard") else None,
                                   int(header["offset"]), view, pull)
                    continue
                if plen:
                    raise TransportError(f"unexpected {plen}-byte payload on {op!r}")
                if op == "end":
                    await asyncio.gather(*verifying, return_exceptions=True)  # their failures fail the node
                    if not pull and self._missing_from(peer, flow_shard, flow=flow) - self._refetching:
                        raise TransportError(f"{peer} ended its stream before sending every block")
                    await close_handshake(conn, self.spec.timeout_s, sent_end=False)
                    return True
                block = str(header.get("block"))
                if block not in self.slot_count:
                    raise TransportError(f"{peer} sent block {block!r} that {self.me} does not receive")
                shard = tuple(header["shard"]) if header.get("shard") else None
                if op == "commit":
                    if self._mark_committed(block, shard):
                        # Verify off the receive path: the next block streams in while this one hashes.
                        verifying.append(self._spawn(self._verify(block), f"verification of {block}"))
                elif op == "abort":
                    await self._forward({"op": "abort", "block": block}, b"", block, shard)
                else:
                    raise TransportError(f"unexpected op {op!r}")
        except Exception as e:  # whatever went wrong, this stream is over: recover what it still owed
            kind = "" if isinstance(e, TransportError) else f"{type(e).__name__}: "
            log.warning("%s: %s %s failed: %s%s", self.me, "fallback" if pull else "upstream", peer, kind, e)
            if not pull:
                with contextlib.suppress(Exception):
                    await conn.abort()  # a stream we stopped reading must not stall its sender until timeout
                self._drop_what_held_us_back()
                self._upstream_lost(peer, flow_shard, flow=flow)
            return False

    async def _recv_payload(self, conn: Connection, view: memoryview, pull: bool) -> None:
        """A chunk's payload into its place; test-only faults cut, desync or slow an inbound push."""
        f = self.faults
        if not pull and f:
            seen = self.bytes_in + len(view)
            if "cutInboundAfterBytes" in f and seen > int(f["cutInboundAfterBytes"]) and not f.get("_cut"):
                f["_cut"] = True
                await conn.close()
                raise TransportError("fault injection: inbound connection cut")
            if "desyncInboundAfterBytes" in f and seen > int(f["desyncInboundAfterBytes"]) and not f.get("_desync") \
                    and len(view) > PREFIX.size:
                f["_desync"] = True  # read less than the frame holds: the rest is parsed as the next frame
                view = view[:len(view) - PREFIX.size]
            if float(f.get("recvRateMBps", 0)):
                await asyncio.sleep(len(view) / (float(f["recvRateMBps"]) * 1e6))
        await conn.recv_into(view, timeout=self.spec.timeout_s)

    def _chunk_target(self, block: str, header: Header, plen: int) -> memoryview:
        """Where a chunk's payload lands: its place in the block buffer (checked first), or a scratch
        buffer for a block that is already resident (a duplicate after a re-fetch)."""
        if block not in self.slot_count:
            raise TransportError(f"chunk of block {block!r} that {self.me} does not receive")
        if block in self.resident:
            return memoryview(bytearray(plen))
        size = int(self.spec.manifest[block]["bytes"])
        shard = tuple(header["shard"]) if header.get("shard") else None
        begin, end = shard_range(size, shard)
        offset = int(header["offset"])
        if not begin <= offset <= offset + plen <= end:
            raise TransportError(f"chunk of {block!r} at {offset}+{plen} outside [{begin}, {end})")
        buf = self.buffers.get(block)
        if buf is None:
            buf = self.buffers[block] = self.arena.take(block, size)
        return buf[offset:offset + plen]

    async def _on_chunk(self, block: str, shard: tuple[int, int] | None, offset: int, payload: memoryview,
                        pull: bool = False) -> None:
        """The chunk is already in the block buffer: forward it downstream at once (cut-through)."""
        if block in self.resident:
            return
        self.bytes_in += len(payload)
        if self.faults.get("corruptBlock") == block and not self.faults.get("_corrupted"):
            payload[0] ^= 0xFF  # test-only: this node corrupts what it received (once)
            self.faults["_corrupted"] = True
        if self.transport.hash_on_landing:
            self._landed(block, offset, len(payload))  # after the fault above: what is hashed is what stays
        await self._forward_chunk(
            {"op": "chunk", "block": block, "offset": offset}, payload, block, shard, lag=not pull
        )

    def _landed(self, block: str, offset: int, nbytes: int) -> None:
        """A chunk's bytes are in the block buffer: hash what that made contiguous, now. The socket read
        that put them there ran on this thread, so they are still in its cache; hashing a whole block at
        commit instead re-reads it from memory (measured: that pass held a TCP relay hop to ~0.75 of raw
        on 2 cores, hashing here ~0.97; ADR 0003)."""
        v = self.verifiers.get(block)
        if v is None:
            v = self.verifiers[block] = BlockVerifier(self.buffers[block], str(self.spec.manifest[block]["digest"]))
        job = v.landed(offset, nbytes)
        if job is not None:
            job()

    def _mark_committed(self, block: str, shard: tuple[int, int] | None) -> bool:
        """Record an upstream commit; True when every shard of the block is in (verify it next)."""
        if block in self.resident:
            return False
        slots = self.done_slots.setdefault(block, set())
        slots.add(shard[0] if shard else None)
        self._refetching.discard((block, shard[0] if shard else None))
        return len(slots) >= self.slot_count[block]

    async def _verify(self, block: str) -> None:
        if block in self.resident:
            return
        buf = self.buffers[block]
        entry = self.spec.manifest[block]
        # The verifier has hashed most of the block as it landed; its check hashes the rest and compares
        # (the whole buffer where streaming was given up). A block with no chunk landed here has none.
        v = self.verifiers.get(block)
        check = v.seal() if v is not None else (lambda: digest_matches(buf, str(entry["digest"])))
        # Off this loop: the check is short when the verifier streamed, a whole block when it gave up (or
        # there is none); xxhash/hashlib release the GIL, so receiving goes on meanwhile.
        ok = await asyncio.to_thread(check)
        if self.verifiers.get(block) is v:
            self.verifiers.pop(block, None)  # a re-fetch after a bad digest starts a fresh one
        if not ok:
            self.corrupt_detected += 1
            log.warning("%s: block %s failed its digest; aborting downstream and re-fetching", self.me, block)
            self.done_slots.pop(block, None)
            await self._forward({"op": "abort", "block": block}, b"", block, None, all_shards=True)
            await self._refetch_from_fallbacks({(block, None)})  # TransferFailed fails the node (see _spawn)
            return
        self.resident[block] = Block(block, buf, index_from_manifest(entry), entry["digest"])
        await self._forward({"op": "commit", "block": block}, b"", block, None, all_shards=True)
        self.on_progress({"event": "block", "instance": self.me, "block": block, "resident": len(self.resident),
                          "total": len(self.plan.model.block_ids), "bytes": self.bytes_in})
        if all(b in self.resident for b in self.plan.model.block_ids):
            self.done_at = time.time()
            self.all_resident.set()
