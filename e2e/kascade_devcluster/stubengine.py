"""A stand-in engine that speaks the engine's OpenAI wire format (JSON or SSE) with no model behind it:
for the router's unit tests and `bench/router.py`, where the router is what is measured. Real engines
are used everywhere the engine matters (tests/e2e, the demo).

Data flow: POST /v1/completions -> `tokens` SSE chunks `data: {...}` spaced `delay_s` apart, then
`data: [DONE]` (or one JSON body when not streaming). Every request is recorded (`seen`: request id,
arrival time, whether it finished or the client went away). `status` makes it answer e.g. 503 (a
draining engine); `hold` makes streams wait after their first chunk until released (tests of
unbuffered streaming and disconnects).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kascade_planner.engine_api import SERVING_SHARE_HEADER


@dataclass
class Seen:
    request_id: str
    model: str
    arrival: float
    finished: bool = False
    disconnected: bool = False


@dataclass
class StubEngine:
    name: str = "stub"
    tokens: int = 4
    delay_s: float = 0.0
    status: int = 200
    hold: asyncio.Event | None = None  # set: streams continue after their first chunk
    share: str | None = None  # sent as the engine's serving-share header (a live replica's layer share)
    seen: list[Seen] = field(default_factory=list)
    readyz: int = 0  # /readyz answers given
    port: int = 0
    _runner: web.AppRunner | None = None
    _open: set[Any] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> StubEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/readyz", self._ready)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def abort(self) -> None:
        """Die like a killed process: every open connection is reset, nothing more is sent."""
        for t in list(self._open):
            t.abort()

    async def _ready(self, _: web.Request) -> web.Response:
        """Like the engine's: ready, with its serving share (routers refresh a live replica's weight here)."""
        self.readyz += 1
        return web.Response(text="ready", headers=self._share())

    def _share(self) -> dict[str, str]:
        return {SERVING_SHARE_HEADER: self.share} if self.share is not None else {}

    def _chunk(self, i: int, done: bool) -> bytes:
        c = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if done else None,
                          "logprobs": None}]}
        return b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        doc: dict[str, Any] = await request.json()
        s = Seen(request.headers.get("X-Request-Id", ""), str(doc.get("model")), time.monotonic())
        self.seen.append(s)
        self._open.add(request.transport)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} is unavailable", "type": "unavailable"}},
                                     status=self.status)
        if not doc.get("stream"):
            if self.delay_s:
                await asyncio.sleep(self.delay_s * self.tokens)
            s.finished = True
            return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": doc.get("model"),
                                      "choices": [{"index": 0, "text": "".join(f" t{i}" for i in range(self.tokens)),
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": self.tokens,
                                                "total_tokens": 1 + self.tokens}, "served_by": self.name},
                                     headers=self._share())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Served-By": self.name,
                                           **self._share()})
        try:
            await resp.prepare(request)
            for i in range(self.tokens):
                await resp.write(self._chunk(i, i == self.tokens - 1))
                if i == 0 and self.hold is not None:
                    await self.hold.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            s.finished = True
        except (asyncio.CancelledError, ConnectionError):
            s.disconnected = True
            raise
        finally:
            self._open.discard(request.transport)
        return resp


def main() -> None:  # pragma: no cover - a process for bench/router.py
    import argparse

    ap = argparse.ArgumentParser(description="an engine stub speaking the OpenAI wire format (no model)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds between streamed chunks")
    args = ap.parse_args()

    async def run() -> None:
        stub = await StubEngine(tokens=args.tokens, delay_s=args.delay).start(args.port)
        print(f"KASCADE_STUB_READY http={stub.port}", flush=True)
        await asyncio.Event().wait()

    try:  # the same event loop as the router's (`kascade router` uses uvloop when installed)
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":  # pragma: no cover
    main()
