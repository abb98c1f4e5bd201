"""Recovery of a transfer node: what an upstream still owed is pulled from the plan's fallback sources,
and a node serves such pulls from its resident blocks.

Data flow: upstream lost (stream failed, ended early, silent past the timeout) or never connected
(`_watchdog`) -> `_missing_from` -> `_refetch_from_fallbacks`: a `pull` of whole blocks from each
fallback in turn (two rounds) -> the same `_consume` path as a push (verify, forward downstream) ->
resident; a block that still fails after `max_refetch_per_block` re-fetches, or no fallback at all,
is a `TransferFailed` naming it. A mixin of `relay.TransferNode`, which owns the state declared below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kascade_engine.net import peerauth
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.net.transport import Connection, Transport, TransportError, close_handshake
from kascade_engine.weights.blocks import Block
from kascade_engine.weights.blockverify import BlockVerifier
from kascade_planner.plan import Flow, Plan

log = logging.getLogger(__name__)
Slot = tuple[str, int | None]  # (block, shard index or None for the whole block)


class TransferFailed(RuntimeError):
    pass


class Recovery:
    """Re-fetching and serving pulls for `relay.TransferNode` (state declared here, set in its __init__)."""

    spec: TransferSpec
    plan: Plan
    me: str
    transport: Transport
    inbound: tuple[Flow, ...]
    resident: dict[str, Block]
    verifiers: dict[str, BlockVerifier]
    slot_count: dict[str, int]
    done_slots: dict[str, set[int | None]]
    error: Exception | None
    refetches: int
    max_refetch_per_block: int
    _refetched: dict[str, int]
    _refetching: set[Slot]
    _connected: set[str]

    if TYPE_CHECKING:
        def _spawn(self, coro: Any, what: str) -> asyncio.Task[Any]: ...

        def _fail(self, e: Exception) -> None: ...

        async def _consume(self, conn: Connection, peer: str, flow_shard: tuple[int, int] | None = None,
                           pull: bool = False, flow: Flow | None = None) -> bool: ...

    def _missing_from(self, peer: str, shard: tuple[int, int] | None = None, any_shard: bool = False,
                      flow: Flow | None = None) -> set[Slot]:
        out: set[Slot] = set()
        for f in self.inbound if flow is None else (flow,):
            if f.src == peer and (any_shard or f.shard == shard):
                slot = f.shard[0] if f.shard else None
                for b in f.blocks:
                    if b not in self.resident and slot not in self.done_slots.get(b, ()):
                        out.add((b, slot))
        return out

    def _upstream_lost(self, peer: str, shard: tuple[int, int] | None = None, any_shard: bool = False,
                       flow: Flow | None = None) -> None:
        missing = self._missing_from(peer, shard, any_shard, flow) - self._refetching
        if missing:
            self._spawn(self._refetch_from_fallbacks(missing), f"re-fetch of {len(missing)} block(s)")

    async def _watchdog(self) -> None:
        await asyncio.sleep(self.spec.timeout_s)
        for f in self.inbound:
            if f.src not in self._connected:
                log.warning("%s: upstream %s never connected; re-fetching its blocks", self.me, f.src)
                self._upstream_lost(f.src, any_shard=True)

    async def _refetch(self, slots: set[Slot]) -> None:
        try:
            await self._refetch_from_fallbacks(slots)
        except TransferFailed as e:
            self._fail(e)

    async def _refetch_from_fallbacks(self, slots: set[Slot]) -> None:
        """Pull `slots` (whole blocks: simpler and always correct) from the plan's fallback sources."""
        blocks = sorted({b for b, _ in slots if b not in self.resident}, key=self.plan.model.block_ids.index)
        if not blocks:
            return
        for b in blocks:
            self._refetched[b] = self._refetched.get(b, 0) + 1
            if self._refetched[b] > self.max_refetch_per_block:
                raise TransferFailed(f"{self.me}: block {b!r} still fails after {self.max_refetch_per_block} "
                                     "re-fetches (every fallback serves a bad copy?)")
        self._refetching |= slots
        self.refetches += 1
        for b in blocks:  # re-fetched blocks arrive whole
            self.slot_count[b] = 1
            self.done_slots.pop(b, None)
            self.verifiers.pop(b, None)  # the pull rewrites it from offset 0: hash it afresh
        fallbacks = [s for s in self.plan.fallbacks_for(self.me) or tuple(s.id for s in self.plan.sources)
                     if s in self.spec.peers and s != self.me]
        # Two rounds: a fallback that was only paused (or busy) past one timeout gets a second chance.
        for attempt, source in enumerate(fallbacks * 2):
            if self.error is not None:  # the node failed meanwhile (e.g. a block that never verifies)
                raise TransferFailed(str(self.error))
            if attempt == len(fallbacks):
                await asyncio.sleep(min(1.0, self.spec.timeout_s / 2))
            host, port = self.spec.peers[source]
            try:
                conn = await self.transport.connect(host, port, timeout=self.spec.timeout_s)
                await peerauth.join(conn, self.spec.token, "transfer", self.spec.timeout_s,
                                    **{"from": self.me, "role": "pull"})
                await conn.send({"op": "pull", "blocks": blocks}, timeout=self.spec.timeout_s)
                ok = await self._consume(conn, source, pull=True)
                with contextlib.suppress(TransportError):
                    await conn.close()
                if ok and all(b in self.resident for b in blocks):
                    log.info("%s: re-fetched %d block(s) from %s", self.me, len(blocks), source)
                    return
            except TransportError as e:
                log.warning("%s: fallback %s failed: %s", self.me, source, e)
        raise TransferFailed(f"{self.me}: no fallback could provide {blocks}")

    async def _serve_pull(self, conn: Connection) -> None:
        req, _ = await conn.recv(timeout=self.spec.timeout_s, max_payload=0)
        if req.get("op") != "pull" or not isinstance(req.get("blocks"), list):
            raise TransportError("expected a pull request")
        for block in req["blocks"]:
            have = self.resident.get(str(block))
            if have is None:
                await conn.send(
                    {"op": "error", "message": f"{self.me} does not hold {block!r}"}, timeout=self.spec.timeout_s
                )
                return
            for off in range(0, have.nbytes, self.spec.chunk_bytes):
                await conn.send({"op": "chunk", "block": have.id, "shard": None, "offset": off},
                                have.data[off:off + self.spec.chunk_bytes], timeout=self.spec.timeout_s)
            await conn.send({"op": "commit", "block": have.id, "shard": None}, timeout=self.spec.timeout_s)
        await conn.send({"op": "end"}, timeout=self.spec.timeout_s)
        await close_handshake(conn, self.spec.timeout_s, sent_end=True)
