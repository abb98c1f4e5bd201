"""The router's client-side guards: what it refuses before a request reaches a route (the engine's
`kascade_engine.http.httpguard`, rebuilt for aiohttp: the router imports nothing of the engine).

- Header timeout: aiohttp's keep-alive timer, armed when a connection opens and after every answer, closes a
  connection still waiting for a complete request then; `header_timeout_s` is passed as that timer
  (`runner_kwargs`). Before, it was aiohttp's default of an hour: 150 slow-header connections stayed open.
- Body timeout and size: `proxy.read_body` (408, 413).
- Connection cap: `CappedFactory` makes the protocol for each accepted connection; beyond `cap` open ones the
  new connection gets `503` + `Retry-After` and is closed (20,400 idle connections exhausted the router's file
  descriptors and /healthz failed, with nothing logged). The cap is also kept under what RLIMIT_NOFILE allows
  (each proxied request holds a client and an engine socket).
- Refusals are logged through `RateLimitedLog`: one line per `every_s` with the count since (the engine's
  one WARNING per refused connection made 19,376 lines).

Data flow: listening socket -> `CappedFactory()` -> aiohttp's RequestHandler (or `_Refused`) -> routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors kept for the watch, probes, logs


class RateLimitedLog:
    """At most one WARNING per `every_s` for one kind of event, carrying how many happened since the last."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger, self.every_s = logger, every_s
        self.count = 0  # events since the last line
        self.total = 0
        self._last = -float("inf")

    def warning(self, msg: str, *args: Any) -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self.logger.warning(msg + " (%d such in the last %.0f s)", *args, self.count,
                                min(now - self._last, 1e9) if self._last > -float("inf") else 0)
            self._last, self.count = now, 0


def fd_cap(max_connections: int) -> int:
    """`max_connections`, lowered to what the process's descriptor limit leaves for client connections (each
    proxied request also holds an engine connection)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return max_connections
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, (soft - FD_RESERVE) // 2))


def _refusal(retry_after_s: int, cap: int) -> bytes:
    body = json.dumps({"error": {"message": f"the router has {cap} open connections (its limit); retry later",
                                 "type": "unavailable", "param": None, "code": 503}}).encode()
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {retry_after_s}"
            f"\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class _Refused(asyncio.Protocol):
    """A connection over the cap: one 503 and closed (the client need not even send its request)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t: Any = transport
        t.write(self.answer)
        t.close()


class CappedFactory:
    """The protocol factory for the listening socket: aiohttp's handler while fewer than `cap` connections are
    open (counted by aiohttp's server: `connections`), else `_Refused`."""

    def __init__(self, server: Any, cap: int, retry_after_s: int, name: str = "client") -> None:
        self.server, self.cap, self.name = server, cap, name
        self.answer = _refusal(retry_after_s, cap)
        self.refusals = RateLimitedLog(log)

    def __call__(self) -> asyncio.BaseProtocol:
        open_now = len(self.server.connections)
        if open_now >= self.cap:
            self.refusals.warning("refusing a %s connection: %d open (limit %d)", self.name, open_now, self.cap)
            return _Refused(self.answer)
        made: Callable[[], asyncio.BaseProtocol] = self.server
        return made()


def runner_kwargs(header_timeout_s: float) -> dict[str, Any]:
    """aiohttp server arguments: the keep-alive timer is the header timeout (see the module docstring)."""
    return {"keepalive_timeout": header_timeout_s}
