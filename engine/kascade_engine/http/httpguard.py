"""HTTP guard: what the engine's HTTP front refuses before a request reaches a route.

uvicorn bounds header size (h11) but not the time a client takes to send its headers (its keep-alive
timer starts only after a first response), nor how many connections it holds, nor the body size. So:

- `GuardedH11Protocol` (uvicorn's `http=` protocol class): a connection that has not completed a
  request's headers within `HEADER_TIMEOUT_S` of opening (or of its last response) is closed (slowloris);
  beyond `MAX_CONNECTIONS` open connections a new one is closed at once (before this, 20,000 idle
  sockets exhausted the file descriptors).
- `BodyLimit` (ASGI middleware): a body larger than `MAX_BODY_BYTES` is refused with 413 (by its
  Content-Length before reading, or once that many bytes arrived), a body not complete within
  `BODY_TIMEOUT_S` with 408; the body is read here once and replayed to the app, so later `receive()`
  calls still report the client's disconnect.
Data flow: socket -> GuardedH11Protocol -> BodyLimit -> FastAPI routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024
MAX_BODY_BYTES = 4 << 20  # a prompt of max-prompt-tokens is far smaller; chat histories fit easily
BODY_TIMEOUT_S = 30.0


REFUSAL_LOG_EVERY_S = 10.0
_refusals = {"count": 0, "logged": -REFUSAL_LOG_EVERY_S}


def _refused(client: Any, open_now: int, limit: int) -> None:
    """One warning per REFUSAL_LOG_EVERY_S with the count since the last (one per refused connection wrote
    19,376 lines under a flood; issue 38)."""
    _refusals["count"] += 1
    now = time.monotonic()
    if now - _refusals["logged"] >= REFUSAL_LOG_EVERY_S:
        log.warning("refusing a connection from %s: %d open (limit %d); %d refused since the last report",
                    client, open_now, limit, _refusals["count"])
        _refusals.update(count=0, logged=now)


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _refused(self.client, len(self.connections), self.max_connections)
            transport.close()
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request headers since armed
        if waiting and not self.transport.is_closing():
            log.info("closing %s: no complete request headers within %.0f s", self.client, self.header_timeout_s)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._header_timer.cancel()
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


def guarded(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> type[H11Protocol]:
    """The protocol class with these limits (uvicorn instantiates it per connection)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s,
                                                      "max_connections": max_connections})


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _reply(send, 413, f"request body of {length.decode(errors='replace')} bytes exceeds "
                                    f"{self.max_bytes}")
            return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body = msg.get("body", b"")
                    size += len(body)
                    if size > self.max_bytes:
                        await _reply(send, 413, f"request body exceeds {self.max_bytes} bytes")
                        return
                    chunks.append(body)
                    if not msg.get("more_body"):
                        break
        except TimeoutError:
            await _reply(send, 408, f"request body not complete within {self.timeout_s:.0f} s")
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return dict(await receive())  # after the body: the client's disconnect, when it comes

        await self.app(scope, replay, send)


async def _reply(send: Any, status: int, message: str) -> None:
    data = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
