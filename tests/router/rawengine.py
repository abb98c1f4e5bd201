"""A raw-socket engine for the router's fault tests: an asyncio server whose every connection is recorded
(opened, request bytes, closed) and answered by a `behaviour`: `answer` (a JSON completion after `delay_s`,
Content-Length framed, or chunked with `chunked`), `hang` (read the request, answer nothing: a replica that is
stopped or wedged), `close` (close before answering: an engine's connection-cap refusal), `status` (answer
`status`, e.g. 503 with Retry-After). The stub engine (kascade_devcluster.stubengine) is aiohttp; this one
can do what an aiohttp app cannot (hang on every connection, answer twice, tell when a client left)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field


@dataclass
class Conn:
    opened: float
    data: bytearray = field(default_factory=bytearray)
    closed: float | None = None
    answered: bool = False


@dataclass
class RawEngine:
    behaviour: str = "answer"
    delay_s: float = 0.0
    status: int = 200
    body: bytes = b""  # the answer's body ("" = a small completion)
    chunked: bool = False
    hold: asyncio.Event | None = None  # chunked: after the first chunk, wait for this
    extra: bytes = b""  # written after the answer on the same connection (an unsolicited response)
    conns: list[Conn] = field(default_factory=list)
    probes: int = 0  # GET /readyz answered
    sent: int = 0  # chunked body bytes written (drain returned: the router took them)
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> RawEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()

    def requests(self) -> int:
        return sum(c.data.count(b"POST ") for c in self.conns)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        c = Conn(time.monotonic())
        self.conns.append(c)
        self._writers.add(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                c.data += head
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                c.data += await r.readexactly(length)
                if head.startswith(b"GET /readyz") and self.behaviour != "hang":  # a live engine answers its probe
                    self.probes += 1
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nready")
                    await w.drain()
                    continue
                if self.behaviour == "close":
                    w.close()
                    break
                if self.behaviour == "hang":
                    await r.read()  # until the peer closes
                    break
                if self.delay_s:
                    done = asyncio.create_task(asyncio.sleep(self.delay_s))
                    gone = asyncio.create_task(r.read())  # the router closed the connection meanwhile?
                    await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if gone.done():
                        done.cancel()
                        break
                    gone.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await gone
                body = self.body or json.dumps({"id": "raw", "object": "text_completion", "choices": [
                    {"index": 0, "text": " ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                head_out = f"HTTP/1.1 {self.status} X\r\ncontent-type: application/json\r\n"
                if self.status == 503:
                    head_out += "retry-after: 3\r\n"
                if self.chunked:
                    step = 1 << 16
                    w.write(f"{head_out}transfer-encoding: chunked\r\n\r\n".encode())
                    for i in range(0, len(body), step):
                        piece = body[i:i + step]
                        w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await w.drain()
                        self.sent += len(piece)
                        if i == 0 and self.hold is not None:
                            await self.hold.wait()
                    w.write(b"0\r\n\r\n")
                else:
                    w.write(f"{head_out}content-length: {len(body)}\r\n\r\n".encode() + body)
                c.answered = True
                if self.extra:
                    await w.drain()
                    await asyncio.sleep(0.05)
                    w.write(self.extra)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            c.closed = time.monotonic()
            self._writers.discard(w)
            w.close()
