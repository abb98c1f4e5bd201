"""Engine connections for the router's hot path: a pooled HTTP/1.1 client whose streamed answers go from
the engine's socket to the client's socket inside the protocol callback.

Why not an HTTP client library: with aiohttp on the engine side every relayed SSE chunk was parsed into a
stream reader, woke the handler task, and was chunk-encoded again on the way out (~50-80 us of CPU per
chunk, most of the router's cost per stream). Here a chunk costs one `transport.write` of the engine's own
bytes: the client's response is chunked too, so the engine's chunk framing is kept as is and only the
terminating chunk is held back (the caller's `write_eof` sends it).

Data flow: `Upstreams.request(address, path, body, headers)` -> a keep-alive connection to that engine
(pooled per address; a pooled connection the engine closed meanwhile is replaced once, transparently) ->
request bytes written -> `Answer` once the status line and headers arrived -> either `read()` (the whole
body, Content-Length or chunked) or `first_data()` then `relay(client_transport, framed)`: body bytes go
to the client as they arrive, raw framed chunks (an HTTP/1.1 client) or the decoded payload (HTTP/1.0,
delimited by close); `finished()` returns at the engine's terminating chunk, raises `UpstreamError` on a
failure or `read_timeout_s` of silence. A client transport buffering more than HIGH_WATER pauses reading
from the engine (TCP backpressure reaches the engine) until it drains below LOW_WATER.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from collections.abc import Callable
from typing import cast

HIGH_WATER = 256 << 10  # client write buffer above this: stop reading from the engine
LOW_WATER = 64 << 10
MAX_HEAD = 64 << 10  # an engine's status line + headers beyond this are refused
TAIL = 4096  # a non-streamed answer's last bytes kept (its usage is at its end)
IDLE_S = 4.0  # pooled connections idle longer are closed: under uvicorn's default 5 s keep-alive timeout
_CRLF = b"\r\n"


class UpstreamError(Exception):
    """The engine connection failed; `answered` says whether any body byte had arrived."""

    def __init__(self, message: str, answered: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.answered = answered
        self.refused = refused  # nothing listens there (the process is gone): health ejects it at once


class _Stale(UpstreamError):
    """A reused pooled connection was closed by the engine before any answer: retry on a fresh one."""


class Answer(asyncio.Protocol):
    """One engine connection (the asyncio protocol) and the answer in progress on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, address: str) -> None:
        self.loop, self.address = loop, address
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reused = False
        self.pooled = False  # idle in the pool: any byte arriving now is unsolicited
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.events = 0  # SSE data events relayed ([DONE] not counted)
        self._token_after = 0  # `on_token`: the callback runs once more than this many events were relayed
        self._on_token: Callable[[], None] | None = None
        self._tail = b""
        self.last_rx = self.loop.time()
        self._head = bytearray()
        self._in_body = False
        self._chunked = False
        self._length: int | None = None  # Content-Length left to read
        self._left = b""  # a partial chunk-size line or CRLF kept for the next bytes
        self._data_left = 0  # payload bytes left in the current chunk
        self._state = "size"  # chunked: size | data | crlf | trailer
        self._body = bytearray()  # collected (before relay, or read())
        self._pending: list[bytes] = []  # raw body bytes received before the caller chose read or relay
        self._collecting = False  # the caller chose read(): body bytes are parsed as they arrive
        self._client: asyncio.BaseTransport | None = None
        self._framed = True
        self._got_data = False
        self._at_boundary = True  # relayed bytes end at a chunk boundary (an error event can follow)
        self._headed: asyncio.Future[None] = self.loop.create_future()
        self._first: asyncio.Future[None] = self.loop.create_future()
        self._done: asyncio.Future[None] = self.loop.create_future()
        self.keep_alive = True
        self.keep_tail = False  # keep the last TAIL bytes relayed (a non-streamed answer's usage)
        self.tail = b""

    # -- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not isinstance: uvloop's transports implement the interface without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.loop.time()
        if self.pooled or self._done.done():
            # nothing was asked: an answer here would be handed to the next request sent on this connection
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()
            return
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    self._fail(f"response headers exceed {MAX_HEAD} bytes")
                return
            rest = bytes(self._head[end + 4:])
            try:
                self._parse_head(bytes(self._head[:end]))
            except ValueError as e:
                self._fail(f"malformed response from the engine: {e}")
                return
            self._in_body = True
            self._head = bytearray()
            if not self._headed.done():
                self._headed.set_result(None)
            if self._length == 0 and not self._chunked:
                self._finish()
                return
            if not rest:
                return
            data = rest
        if self._client is None and not self._collecting:
            self._pending.append(data)
            if not self._got_data:
                self._got_data = True
                if not self._first.done():
                    self._first.set_result(None)
            return
        self._consume(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.keep_alive = False
        if self._client is None and self._pending and not self._done.done():
            # body bytes the caller has not asked for yet (read or relay): they may hold the whole answer
            pending, self._pending = self._pending, []
            for piece in pending:
                self._consume(piece)
        if self._done.done():
            return
        if self._in_body and not self._chunked and self._length is None:
            self._finish()  # delimited by close
            return
        why = f": {exc}" if exc else ""
        if not self._in_body and self.reused and not self._head:
            self._fail_with(_Stale(f"pooled connection closed by the engine{why}"))
        else:
            self._fail(f"engine closed the connection{' mid-answer' if self._in_body else ' before answering'}{why}")

    # -- parsing ------------------------------------------------------------------------------------------
    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"status line {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"header line {line[:80]!r}")
            self.headers[name.strip().lower()] = value.strip()
        te = self.headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        if not self._chunked and "content-length" in self.headers:
            n = self.headers["content-length"]
            if not n.isdigit():
                raise ValueError(f"Content-Length {n[:40]!r}")
            self._length = int(n)
        conn = self.headers.get("connection", "").lower()
        if "close" in conn or parts[0] == "HTTP/1.0" or (not self._chunked and self._length is None):
            self.keep_alive = False

    def _consume(self, data: bytes) -> None:
        """Body bytes -> collected payload, or the client (raw framed bytes or payload)."""
        if not self._got_data:
            self._got_data = True
            if not self._first.done():
                self._first.set_result(None)
        if not self._chunked:
            if self._length is not None:
                if len(data) > self._length:
                    self.keep_alive = False  # bytes past the answer: the connection carries no other
                data = data[:self._length]
                self._length -= len(data)
            self._emit_payload(data)
            if self._length == 0:
                self._finish()
            return
        buf = self._left + data if self._left else data
        self._left = b""
        i, n = 0, len(buf)
        fwd_from = -1 if self._state == "trailer" else 0  # past the terminator nothing is relayed
        while i < n and not self._done.done():
            st = self._state
            if st == "data":
                take = min(self._data_left, n - i)
                if self._client is None or not self._framed:
                    self._emit_payload(buf[i:i + take])
                i += take
                self._data_left -= take
                if self._data_left == 0:
                    self._state = "crlf"
            elif st == "crlf":
                if n - i < 2:
                    self._left = buf[i:]
                    i = n
                    break
                if buf[i:i + 2] != _CRLF:
                    self._fail("malformed chunk: no CRLF after its data")
                    return
                i += 2
                self._state = "size"
            elif st == "size":
                j = buf.find(_CRLF, i)
                if j < 0:
                    if n - i > 1024:
                        self._fail("malformed chunk: size line too long")
                        return
                    self._left = buf[i:]
                    i = n
                    break
                try:
                    size = int(buf[i:j].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(f"malformed chunk size {bytes(buf[i:j][:20])!r}")
                    return
                if size == 0:  # the terminator: relay what precedes it; the caller's write_eof ends the answer
                    self._forward(buf, fwd_from, i)
                    fwd_from = -1
                    self._state = "trailer"
                    i = j + 2
                else:
                    self._data_left = size
                    self._state = "data"
                    i = j + 2
            else:  # trailer lines until an empty one
                j = buf.find(_CRLF, i)
                if j < 0:
                    self._left = buf[i:]
                    i = n
                    break
                if j == i:
                    if j + 2 < n:
                        self.keep_alive = False  # bytes past the answer: the connection carries no other
                    self._finish()
                    return
                i = j + 2
        if fwd_from >= 0:
            end = n - len(self._left)
            self._forward(buf, fwd_from, end)
            self._at_boundary = self._state == "size" and not self._left

    def _forward(self, buf: bytes, start: int, end: int) -> None:
        if self._client is not None and self._framed and end > start:
            piece = buf[start:end] if start or end < len(buf) else buf
            self._count(piece)
            self._write(piece)

    def _emit_payload(self, piece: bytes) -> None:
        if not piece:
            return
        if self._client is None:
            self._body += piece
        else:
            self._count(piece)
            if self._framed and not self._chunked:  # an engine answer delimited otherwise: frame it here
                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
            self._write(piece)

    def _count(self, piece: bytes) -> None:
        """SSE data events relayed; a marker split between two reads is found in (tail of the previous
        piece + this one), and markers wholly inside that tail were counted with the previous piece."""
        if self.keep_tail:
            self.tail = (self.tail + piece)[-TAIL:]
        tail = self._tail
        joined = tail + piece
        self.events += (joined.count(b"data: ") - tail.count(b"data: ")
                        - joined.count(b"data: [DONE]") + tail.count(b"data: [DONE]"))
        self._tail = joined[-11:]
        if self._on_token is not None and self.events > self._token_after:
            cb, self._on_token = self._on_token, None
            cb()

    def _write(self, piece: bytes) -> None:
        client = cast(asyncio.WriteTransport, self._client)
        if client.is_closing():
            self._fail("the client went away")
            return
        client.write(piece)
        if client.get_write_buffer_size() > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            self.loop.call_later(0.005, self._maybe_resume)

    def _maybe_resume(self) -> None:
        client, up = cast(asyncio.WriteTransport | None, self._client), self.transport
        if self._done.done() or client is None or up is None:
            return
        if client.is_closing():
            self._fail("the client went away")
        elif client.get_write_buffer_size() <= LOW_WATER:
            up.resume_reading()
        else:
            self.loop.call_later(0.005, self._maybe_resume)

    def _finish(self) -> None:
        if not self._first.done():
            self._first.set_result(None)
        if not self._done.done():
            self._done.set_result(None)

    def _fail(self, message: str) -> None:
        self._fail_with(UpstreamError(message, self._got_data))

    def _fail_with(self, e: UpstreamError) -> None:
        self.keep_alive = False
        for f in (self._headed, self._first, self._done):
            if not f.done():
                f.set_exception(e)
                f.exception()  # retrieved: only the awaited one matters
        if self.transport is not None:
            self.transport.close()

    # -- the caller's side --------------------------------------------------------------------------------
    async def _wait(self, fut: asyncio.Future[None], timeout: float) -> None:
        """`fut`, or UpstreamError after `timeout` seconds without a byte from the engine."""
        while not fut.done():
            left = self.last_rx + timeout - self.loop.time()
            if left <= 0:
                self._fail(f"no data from the engine for {timeout:g} s")
                break
            try:
                await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError:
                continue
        fut.result()

    async def read(self, timeout: float) -> bytes:
        """The whole body (payload of a chunked answer). Bytes arriving from now on are parsed as they come:
        left waiting they finished nothing, and the answer ended only when the engine closed the idle connection
        (its 10 s header timeout: the router's ~10.2 s PD stalls; ADR 0015)."""
        self._collecting = True
        for piece in self._pending:
            self._consume(piece)
        self._pending.clear()
        await self._wait(self._done, timeout)
        return bytes(self._body)

    async def first_data(self, timeout: float) -> bool:
        """True once a body byte arrived; False if the answer ended without any."""
        await self._wait(self._first, timeout)
        return self._got_data and not (self._done.done() and not self._pending and not self._body)

    def on_token(self, after: int, callback: Callable[[], None] | None) -> None:
        """Call `callback` once, in the socket callback, when the relayed data events exceed `after` (the
        first token of a stream whose first `after` events carry none: a chat answer's role events). Set it
        before `relay`; None removes it."""
        self._token_after, self._on_token = after, callback

    def relay(self, client: asyncio.BaseTransport, framed: bool) -> None:
        """From now on body bytes go to `client` (raw chunks if `framed`, else the payload)."""
        self._client, self._framed = client, framed
        if self._body:  # collected already (the connection closed before this call): one chunk of it
            body, self._body = bytes(self._body), bytearray()
            self._count(body)
            self._write(b"%x\r\n%s\r\n" % (len(body), body) if framed else body)
        pending, self._pending = self._pending, []
        for piece in pending:
            if self._done.done():
                break
            self._consume(piece)

    @property
    def at_boundary(self) -> bool:
        """Relayed bytes end at a chunk boundary: an error chunk can still be written after them."""
        return self._at_boundary

    async def finished(self, timeout: float) -> None:
        await self._wait(self._done, timeout)


class Upstreams:
    """Keep-alive connections to engines, pooled per address (`host:port`, IPv6 as `[h]:port`)."""

    def __init__(self, connect_timeout_s: float, idle_s: float = IDLE_S, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: engines serve HTTPS, verified by this context (kascade_planner.engine_tls); None: plain HTTP."""
        self.connect_timeout_s, self.idle_s, self.tls = connect_timeout_s, idle_s, tls
        self._idle: dict[str, list[Answer]] = defaultdict(list)
        self._heads: dict[tuple[str, str], bytes] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    async def request(self, address: str, path: str, body: bytes, headers: dict[str, str],
                      timeout: float) -> Answer:
        """Send POST `path` to the engine at `address`; returns once its status line and headers arrived.
        Raises UpstreamError (connect failure, refusal, closed before answering, silence past `timeout`)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if any(c in kv for kv in (*headers, *headers.values()) for c in "\r\n"):
            raise UpstreamError(f"a header for {address} contains a line break: {headers!r}")
        for _ in range(2):
            conn = await self._acquire(address)
            assert conn.transport is not None
            head = self._heads.get((address, path))
            if head is None:
                head = self._heads[(address, path)] = f"POST {path} HTTP/1.1\r\nHost: {address}\r\n".encode()
            conn.transport.write(b"%s%sContent-Length: %d\r\n\r\n%s" % (head, extra.encode("latin-1"), len(body), body))
            try:
                await conn._wait(conn._headed, timeout)
            except _Stale:
                continue  # the engine closed it while idle: once more on a fresh connection
            except BaseException:
                # failed, timed out, or the caller cancelled (its client left): closing the connection is what
                # aborts the generation at the engine (a non-streamed answer's head comes at its end)
                conn.keep_alive = False
                if conn.transport is not None:
                    conn.transport.close()
                raise
            return conn
        raise UpstreamError(f"{address}: two connections closed before answering")

    async def _acquire(self, address: str) -> Answer:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(address)
        now = loop.time()
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing() and now - conn.idle_since < self.idle_s:
                conn.pooled = False
                conn._reset()
                conn.reused = True
                return conn
            if conn.transport is not None:
                conn.transport.close()
        host, _, port = address.rpartition(":")
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Answer(loop, address), host.strip("[]"), int(port), ssl=self.tls,
                                       server_hostname="" if self.tls is not None else None),  # names not checked
                self.connect_timeout_s)
        except (OSError, TimeoutError) as e:  # ssl.SSLError (a certificate the CA did not sign) is an OSError
            raise UpstreamError(f"{address} unreachable: {type(e).__name__}: {e}",
                                refused=isinstance(e, ConnectionRefusedError)) from None
        return conn

    def release(self, conn: Answer) -> None:
        """Back to the pool if the answer ended cleanly on a keep-alive connection; else closed."""
        t = conn.transport
        if t is None:
            return
        # a connection whose reading is paused (backpressure when the answer ended) would never see the next answer
        if (conn.keep_alive and conn._done.done() and not conn._done.exception() and not t.is_closing()
                and t.is_reading()):
            conn._client = None
            conn.reused = False
            conn.pooled = True
            conn.idle_since = conn.loop.time()
            self._idle[conn.address].append(conn)
            if self._sweeper is None:
                self._sweeper = conn.loop.call_later(self.idle_s, self._sweep)
        else:
            t.close()

    def _sweep(self) -> None:
        """Close pooled connections idle longer than `idle_s` (not only when next popped: a burst's connections
        would otherwise stay open, holding descriptors at both ends, until the engine closed them)."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - self.idle_s
        for address, conns in list(self._idle.items()):
            keep = [c for c in conns if c.idle_since > cutoff and c.transport is not None
                    and not c.transport.is_closing()]
            for c in conns:
                if c not in keep and c.transport is not None:
                    c.transport.close()
            if keep:
                self._idle[address] = keep
            else:
                del self._idle[address]
        if self._idle:
            self._sweeper = loop.call_later(self.idle_s / 2, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conns in self._idle.values():
            for c in conns:
                if c.transport is not None:
                    c.transport.close()
        self._idle.clear()

    def __len__(self) -> int:
        """Idle pooled connections."""
        return sum(len(v) for v in self._idle.values())
