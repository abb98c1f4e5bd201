"""PeerPool: authenticated activation connections to other pool engines, opened ahead and reused.

A scale-up's critical path should not pay TCP connect + hello: an engine told about a likely peer
ahead of time (cooperate mode "standby": at bind or pool join) opens the connection and completes the
hello then; forming the pair later takes that connection and only sends {"op": "pair"}.

Data flow: `warm(peer)` -> connect + hello -> idle[peer]; `take(peer)` -> a warmed connection (or, if
none is warm or it died, a fresh connect + hello, counted) -> pairsession.open_pair. `handshakes`
counts every connect + hello, so a test can see that a warmed pair formed without one.
"""

from __future__ import annotations

import contextlib
import logging

from kascade_engine.net.peerauth import join
from kascade_engine.net.transport import Connection, Transport, TransportError

log = logging.getLogger(__name__)


def split_peer(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer {peer!r} must be host:port")
    return host, int(port)


class PeerPool:
    def __init__(self, transport: Transport, token: str | None) -> None:
        self.transport, self.token = transport, token
        self.idle: dict[str, list[Connection]] = {}
        self.handshakes = 0  # connect + hello round trips made (ahead or on demand)
        self.reused = 0  # connections handed out already authenticated

    async def _open(self, peer: str) -> Connection:
        host, port = split_peer(peer)
        conn = await self.transport.connect(host, port)
        self.handshakes += 1
        try:
            if self.token is not None:  # peerauth's challenge–response opens every activation connection
                await join(conn, self.token, "activation", timeout=10)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def warm(self, peer: str) -> None:
        """Have one authenticated connection to `peer` ready (no-op if one is)."""
        if not self.idle.get(peer):
            self.idle.setdefault(peer, []).append(await self._open(peer))
            log.info("activation connection to %s warmed ahead", peer)

    async def take(self, peer: str) -> tuple[Connection, bool]:
        """An authenticated connection to `peer` and whether it was warmed ahead."""
        while self.idle.get(peer):
            conn = self.idle[peer].pop()
            if getattr(conn, "closed", False):
                continue
            self.reused += 1
            return conn, True
        return await self._open(peer), False

    async def close(self) -> None:
        for conns in self.idle.values():
            for c in conns:
                with contextlib.suppress(TransportError):
                    await c.close()
        self.idle.clear()
