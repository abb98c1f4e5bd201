"""The router's engine connections (kascade_router.upstream): HTTP/1.1 answers parsed at every byte split,
streamed chunks relayed byte-exact with the terminator held back, bad framing named, a pooled connection the
engine closed replaced once, backpressure from a slow client. Parsing is driven byte by byte through the
protocol (a capture transport stands for the client); the pool runs against a real asyncio server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kascade_router.upstream import HIGH_WATER, Answer, UpstreamError, Upstreams

CHUNKS = [b'data: {"t": 1}\n\n', b'data: {"t": 2}\n\n', b"data: [DONE]\n\n"]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in CHUNKS)
END = b"0\r\nx-trailer: 1\r\n\r\n"


class Capture(asyncio.WriteTransport):
    """Stands for a client's socket: keeps what was written, reports a settable buffer size."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.buffered = 0
        self.closed = False

    def write(self, data: Any) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class Engine(asyncio.Transport):
    """The engine side of a protocol under test: records pause/resume/close."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = self.closed = False
        self.sent = bytearray()

    def write(self, data: Any) -> None:
        self.sent += data

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _answer(loop: asyncio.AbstractEventLoop) -> tuple[Answer, Engine]:
    a, t = Answer(loop, "e:1"), Engine()
    a.connection_made(t)
    return a, t


async def test_relay_is_byte_exact_at_every_split_and_holds_the_terminator_back() -> None:
    raw = HEAD + BODY + END
    loop = asyncio.get_running_loop()
    for cut in range(1, len(raw)):
        for second in (cut, min(len(raw) - 1, cut + 7)):  # two and three pieces
            a, _ = _answer(loop)
            client = Capture()
            a.data_received(raw[:cut])
            if cut >= len(HEAD):
                a.relay(client, framed=True)
            a.data_received(raw[cut:max(cut, second)])
            a.data_received(raw[max(cut, second):])
            if cut < len(HEAD):
                a.relay(client, framed=True)
            await a.finished(1.0)
            assert bytes(client.data) == BODY, (cut, second)
            assert a.events == 2 and a.status == 200 and a.keep_alive


async def test_payload_relay_for_http10_clients_and_collect() -> None:
    loop = asyncio.get_running_loop()
    a, _ = _answer(loop)
    client = Capture()
    a.data_received(HEAD + BODY[:9])
    a.relay(client, framed=False)
    a.data_received(BODY[9:] + END)
    await a.finished(1.0)
    assert bytes(client.data) == b"".join(CHUNKS)
    b, _ = _answer(loop)
    b.data_received(HEAD + BODY + END)
    assert await b.read(1.0) == b"".join(CHUNKS)
    c, _ = _answer(loop)
    c.data_received(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nab")
    c.data_received(b"cdeEXTRA")
    # bytes past the answer: never pooled (they would be the next request's answer; issue 38)
    assert await c.read(1.0) == b"abcde" and c.status == 400 and not c.keep_alive


async def test_an_answer_complete_before_the_engine_closes_is_not_lost() -> None:
    """The engine sends the whole answer and closes before the caller chose read or relay (a PD decode
    engine's non-streamed answer did: the router retried it on another replica, a second prefill)."""
    loop = asyncio.get_running_loop()
    a, _ = _answer(loop)
    a.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    a.connection_lost(None)
    assert await a.read(1.0) == b"hello" and not a.keep_alive
    b, _ = _answer(loop)
    b.data_received(HEAD + BODY + END)
    b.connection_lost(None)
    client = Capture()
    assert await b.first_data(1.0)
    b.relay(client, framed=True)
    await b.finished(1.0)
    assert bytes(client.data) == b"%x\r\n%s\r\n" % (len(b"".join(CHUNKS)), b"".join(CHUNKS)) and b.events == 2


async def test_a_non_chunked_answer_is_framed_for_a_chunked_client() -> None:
    loop = asyncio.get_running_loop()
    a, _ = _answer(loop)
    client = Capture()
    a.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nContent-Length: 6\r\n\r\n")
    a.relay(client, framed=True)
    a.data_received(b"data: ")
    await a.finished(1.0)
    assert bytes(client.data) == b"6\r\ndata: \r\n"


@pytest.mark.parametrize(("raw", "named"), [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXY", "no CRLF after its data"),
    (b"SPDY/9 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno-colon-here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "Content-Length"),
])
async def test_bad_framing_fails_naming_it_and_closes(raw: bytes, named: str) -> None:
    a, t = _answer(asyncio.get_running_loop())
    a.data_received(raw)
    with pytest.raises(UpstreamError, match=named):
        await a.read(1.0)
    assert t.closed and not a.keep_alive


async def test_failure_mid_chunk_is_not_at_a_boundary_and_silence_times_out() -> None:
    loop = asyncio.get_running_loop()
    a, _ = _answer(loop)
    client = Capture()
    a.data_received(HEAD + BODY[:5])
    a.relay(client, framed=True)
    assert not a.at_boundary
    a.connection_lost(ConnectionResetError("reset"))
    with pytest.raises(UpstreamError, match="mid-answer") as e:
        await a.finished(1.0)
    assert e.value.answered
    b, _ = _answer(loop)
    b.data_received(HEAD + BODY)
    b.relay(Capture(), framed=True)
    assert b.at_boundary
    with pytest.raises(UpstreamError, match=r"no data from the engine for 0\.2 s"):
        await b.finished(0.2)


async def test_a_slow_client_pauses_reading_from_the_engine_until_it_drains() -> None:
    loop = asyncio.get_running_loop()
    a, engine = _answer(loop)
    client = Capture()
    a.data_received(HEAD)
    a.relay(client, framed=True)
    client.buffered = HIGH_WATER + 1
    a.data_received(BODY[:20])
    assert engine.paused
    await asyncio.sleep(0.03)
    assert engine.paused  # still full
    client.buffered = 0
    await asyncio.sleep(0.03)
    assert not engine.paused
    client.closed = True  # the client left: the engine connection is dropped (it aborts the request)
    a.data_received(BODY[20:])
    assert engine.closed
    with pytest.raises(UpstreamError, match="client went away"):
        await a.finished(1.0)


async def test_pool_reuses_connections_and_replaces_one_the_engine_closed() -> None:
    await _pool_case()


async def test_streamed_relay_between_real_sockets() -> None:
    await _relay_case()


def test_pool_and_relay_on_uvloop() -> None:
    """`kascade router` runs on uvloop, whose transports do not subclass asyncio's (an isinstance check on
    them failed every streamed request there while the asyncio tests passed)."""
    import uvloop

    uvloop.run(_pool_case())
    uvloop.run(_relay_case())


async def test_a_body_arriving_after_read_began_ends_the_read() -> None:
    await _late_body_case()


def test_a_body_arriving_after_read_began_ends_the_read_on_uvloop() -> None:
    import uvloop

    uvloop.run(_late_body_case())


async def _late_body_case() -> None:
    """uvicorn writes an answer's head and body apart; the body may arrive after the caller awaits `read()`.
    It was kept unparsed for a later read or relay, so `read()` ended only when the engine closed the idle
    connection (its 10 s header timeout): the ~10.2 s PD stalls through the router (ADR 0015).
    The engine here keeps the connection open, as a keep-alive engine does."""
    body = b'{"choices": []}'
    head_sent = asyncio.Event()
    release = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        await writer.drain()
        head_sent.set()
        await asyncio.sleep(0.1)  # the caller is in read() by now
        writer.write(body)
        await writer.drain()
        await release.wait()
        writer.close()

    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    ups = Upstreams(connect_timeout_s=1.0)
    try:
        a = await ups.request(f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "/v1/completions", b"{}", {}, 5.0)
        await head_sent.wait()
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(a.read(5.0), 2.0) == body  # before the fix: TimeoutError here
        assert asyncio.get_running_loop().time() - t0 < 1.0 and a.keep_alive
        ups.release(a)
        assert len(ups) == 1  # pooled: the answer ended cleanly on a keep-alive connection
    finally:
        release.set()
        ups.close()
        srv.close()


async def _relay_case() -> None:
    """An engine answering in pieces (headers, chunks, terminator apart) relayed into a real client socket:
    the client receives the engine's chunk bytes exactly, without the terminator."""
    got = bytearray()
    sink_done = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        for piece in (HEAD, BODY[:7], BODY[7:30], BODY[30:], END):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.extend(await reader.read(-1))
        sink_done.set()

    e_srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    s_srv = await asyncio.start_server(sink, "127.0.0.1", 0)
    ups = Upstreams(connect_timeout_s=1.0)
    try:
        loop = asyncio.get_running_loop()
        client, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", s_srv.sockets[0].getsockname()[1])
        a = await ups.request(f"127.0.0.1:{e_srv.sockets[0].getsockname()[1]}", "/v1/completions", b"{}", {}, 2.0)
        assert await a.first_data(2.0)
        a.relay(client, framed=True)
        await a.finished(2.0)
        assert a.events == 2 and a.keep_alive
        ups.release(a)
        client.close()
        await asyncio.wait_for(sink_done.wait(), 2.0)
        assert bytes(got) == BODY
    finally:
        ups.close()
        e_srv.close()
        s_srv.close()


async def _pool_case() -> None:
    conns: list[int] = []
    answered = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        conns.append(1)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            body = await reader.readexactly(n)
            if answered == 2:  # the third request: close a reused connection without answering (idle race)
                answered += 1
                writer.close()
                return
            answered += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ups = Upstreams(connect_timeout_s=1.0)
    try:
        for i in range(4):
            a = await ups.request(addr, "/v1/completions", b"x%d" % i, {"X-Request-Id": f"r{i}"}, 2.0)
            assert await a.read(2.0) == b"x%d" % i
            ups.release(a)
            assert len(ups) == 1
        assert len(conns) == 2  # one reused twice, one fresh after the engine closed the pooled one
        with pytest.raises(UpstreamError, match="line break"):
            await ups.request(addr, "/v1/completions", b"", {"X-Request-Id": "a\r\nEvil: 1"}, 2.0)
        with pytest.raises(UpstreamError, match="unreachable"):
            await ups.request("127.0.0.1:1", "/v1/completions", b"", {}, 2.0)
    finally:
        ups.close()
        await asyncio.sleep(0.05)  # the server's handlers see the close and end
        server.close()
        await server.wait_closed()


async def test_on_token_fires_once_after_the_events_that_carry_no_token() -> None:
    """A chat stream's role event (here the first of CHUNKS) is no token: with after=1 the callback runs at the
    second event, whether it arrives before relay (collected) or after it, split anywhere; never twice."""
    raw = HEAD + BODY + END
    loop = asyncio.get_running_loop()
    second = len(HEAD) + len(b"%x\r\n%s\r\n" % (len(CHUNKS[0]), CHUNKS[0]))  # where the second event's chunk begins
    marked = raw.index(b"data: ", second) + len(b"data: ")  # its marker is whole from here
    for cut in range(len(HEAD), len(raw)):
        a, _ = _answer(loop)
        calls: list[int] = []
        a.on_token(1, lambda: calls.append(a.events))  # noqa: B023 (run before the next iteration)
        a.data_received(raw[:cut])
        a.relay(Capture(), framed=True)
        assert len(calls) == (cut >= marked), cut
        a.data_received(raw[cut:])
        await a.finished(1.0)
        assert len(calls) == 1 and calls[0] >= 2, cut  # once, at an event past the role event
    a, _ = _answer(loop)
    calls = []
    a.on_token(0, lambda: calls.append(a.events))
    a.on_token(0, None)  # removed: never called
    a.data_received(raw)
    a.relay(Capture(), framed=True)
    await a.finished(1.0)
    assert calls == []


async def test_idle_pooled_connections_are_closed_after_idle_s() -> None:
    """Not only when next popped: a burst's pooled connections held descriptors at both ends until the engine
    closed them (the soak's router kept 140 after its clients had gone)."""
    closed = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.read()  # until the router closes it
        closed.set()

    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    ups = Upstreams(connect_timeout_s=1.0, idle_s=0.2)
    try:
        a = await ups.request(f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", "/v1/completions", b"{}", {}, 2.0)
        assert await a.read(2.0) == b"{}"
        ups.release(a)
        assert len(ups) == 1
        await asyncio.wait_for(closed.wait(), 2.0)
        assert len(ups) == 0
    finally:
        ups.close()
        srv.close()
