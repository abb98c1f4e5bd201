"""Admission on a data-port listener: how many connections it serves, and which ones wait.

A TCP or TLS listener (transport_tcp, transport_tls) counts two kinds of connection: pending ones (accepted,
still in their TLS handshake or peer hello) and admitted ones (peerauth verified that the peer holds the
token). It serves at most MAX_CONNECTIONS admitted connections (a newcomer beyond them is closed on accept)
and holds at most MAX_PENDING pending ones (a newcomer beyond them evicts the oldest): strangers that
connect and never finish can never lock a plan participant out (300 of them used to fill the one shared cap
and fail a transfer; issue 38). Refusals and evictions are logged at most once per REFUSAL_LOG_EVERY_S.

Data flow: accept -> the listener's caps (refuse, or evict the oldest pending) -> the connection is pending,
carrying the listener's hook (`Admissible.on_admit`) -> peerauth verifies the hello -> `conn.admit()` -> the
hook moves it to admitted -> served until it closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

MAX_CONNECTIONS = 256  # authenticated connections served at once per listener
MAX_PENDING = 64  # connections still in their handshake (not yet admitted) per listener
REFUSAL_LOG_EVERY_S = 10.0  # at most one warning per listener and interval for refusals/evictions
log = logging.getLogger(__name__)


class Admissible:
    """What a connection carries for its listener's admission (TcpConnection and TlsConnection are ones)."""

    def __init__(self) -> None:
        self._on_admit: Callable[[], None] | None = None  # set by the listener that accepted it

    def on_admit(self, hook: Callable[[], None]) -> None:
        """The listener's hook, run once when the peer is admitted."""
        self._on_admit = hook

    def admit(self) -> None:
        """The peer proved it holds the token (peerauth): it no longer counts as a pending stranger."""
        if self._on_admit is not None:
            self._on_admit()
            self._on_admit = None


class RefusalLog:
    """One warning per REFUSAL_LOG_EVERY_S with the count since the last (a flood logged one line per
    connection before)."""

    def __init__(self, what: str) -> None:
        self.what, self.count, self.last = what, 0, -REFUSAL_LOG_EVERY_S

    def note(self, message: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= REFUSAL_LOG_EVERY_S:
            log.warning("%s: %s (%d refused or evicted since the last report)", self.what, message, self.count)
            self.last, self.count = now, 0
