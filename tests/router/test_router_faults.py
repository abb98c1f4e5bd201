"""Issue 38's router faults on real sockets: a client leaving a non-streamed request aborts it at the engine,
every replica answering 503 gives the client 503 + Retry-After, an engine closing connections before
answering is not ejected for everyone at once, a hung replica (accepts TCP, answers nothing) is ejected and the
request goes elsewhere, a pooled connection takes no unsolicited response, non-streamed answers are streamed
through (not held whole), per-backend connection caps. Engines are `rawengine.RawEngine` or the stub engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from rawengine import RawEngine

from kascade_devcluster.stubengine import StubEngine
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


@pytest.fixture
async def world() -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    async def make(engines: list[Any], settings: RouterSettings | None = None) -> tuple[Router, str]:
        for e in engines:
            await e.start()
        r = await Router(settings or RouterSettings(hold_timeout_s=2.0),
                         static_routes([f"m={','.join(e.address for e in engines)}"])).start()
        made.extend([r, *engines])
        return r, f"http://127.0.0.1:{r.port}"

    yield make
    for x in made:
        await x.close()


async def post(url: str, body: Any, timeout: float = 20) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body,
                                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, dict(r.headers), await r.read()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_a_client_leaving_a_non_streamed_request_aborts_it_upstream(world: Callable[..., Any]) -> None:
    eng = RawEngine(delay_s=30.0)  # a long answer, generated for nobody if the router keeps waiting
    r, url = await world([eng])
    task = asyncio.create_task(post(url, {"model": "m", "prompt": "x"}))
    assert await until(lambda: eng.requests() == 1)
    task.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await until(lambda: eng.conns[0].closed is not None, 3.0), "the engine connection stayed open"
    assert not eng.conns[0].answered
    assert await until(lambda: r.demand.models[("static", "m")].in_flight == 0)


async def test_every_replica_answering_503_gives_503_and_retry_after(world: Callable[..., Any]) -> None:
    a, b = RawEngine(status=503), RawEngine(status=503)
    _, url = await world([a, b], RouterSettings(hold_timeout_s=0.5, retry_after_s=7))
    st, h, body = await post(url, {"model": "m", "prompt": "x"})
    assert st == 503, body
    assert h["Retry-After"] == "7" and "503" in json.loads(body)["error"]["message"]


async def test_an_engine_closing_before_answering_is_not_ejected_at_once(world: Callable[..., Any]) -> None:
    """Its own connection-cap refusal: one closed connection must not take it away from every request."""
    flaky, good = RawEngine(behaviour="close"), RawEngine()
    r, url = await world([flaky, good], RouterSettings(hold_timeout_s=2.0, eject_after_failures=3))
    fb = r.routes.backends[("static", "m")]["m-0"]
    while flaky.requests() == 0:
        st, _, _ = await post(url, {"model": "m", "prompt": "x"})
        assert st == 200
    assert fb.usable(time.monotonic()), "ejected after one connection closed before answering"
    while flaky.requests() < 3:
        st, _, _ = await post(url, {"model": "m", "prompt": "x"})
        assert st == 200
    assert not fb.usable(time.monotonic()), "3 failures in a row: ejected"


@pytest.mark.chaos
async def test_a_hung_replica_is_ejected_and_the_request_goes_elsewhere(world: Callable[..., Any]) -> None:
    hung, good = RawEngine(behaviour="hang"), RawEngine()
    s = RouterSettings(hold_timeout_s=2.0, first_byte_s=0.5, probe_timeout_s=0.5)
    r, url = await world([hung, good], s)
    hb = r.routes.backends[("static", "m")]["m-0"]
    worst = 0.0
    for _ in range(8):
        t0 = time.monotonic()
        st, _, _ = await post(url, {"model": "m", "prompt": "x"})
        worst = max(worst, time.monotonic() - t0)
        assert st == 200
    assert hung.requests() >= 1 and not hb.usable(time.monotonic())
    assert worst < 3.0, f"a request waited {worst:.1f} s"
    assert await until(lambda: all(c.closed is not None for c in hung.conns[:1]))  # its request was abandoned


async def test_a_pooled_connection_takes_no_unsolicited_response(world: Callable[..., Any]) -> None:
    rogue = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n\"INJECT\"\n"
    eng = RawEngine(extra=rogue)
    _, url = await world([eng])
    st, _, body = await post(url, {"model": "m", "prompt": "x"})
    assert st == 200 and b"INJECT" not in body
    await asyncio.sleep(0.2)  # the unsolicited answer arrives on the idle pooled connection
    # the router drops that connection at once: reused, it was one read away from handing the next client an
    # answer nobody asked for (the old pool kept it and swallowed the bytes, or passed them on when they came late)
    assert eng.conns[0].closed is not None, "the connection that sent an unsolicited answer stayed pooled"
    st, _, body = await post(url, {"model": "m", "prompt": "y"})
    assert st == 200 and b"INJECT" not in body and b'"text": " ok"' in body
    assert len(eng.conns) == 2 and eng.conns[1].data.count(b"POST ") == 1


async def test_a_non_streamed_answer_is_streamed_through(world: Callable[..., Any]) -> None:
    """The answer reaches the client as it arrives: its first bytes before the engine sent the rest (it was held
    whole: 200 MB answers took 682 MB of router memory)."""
    big = json.dumps({"id": "x", "choices": [{"text": "y" * (1 << 20)}],
                      "usage": {"completion_tokens": 5}}).encode()
    hold = asyncio.Event()
    eng = RawEngine(body=big, chunked=True, hold=hold)
    r, url = await world([eng])
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                    json={"model": "m", "prompt": "x"}) as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.read(1000), 3)  # the engine holds the rest meanwhile
        assert first.startswith(b'{"id": "x"')
        hold.set()
        rest = await resp.read()
    assert len(first) + len(rest) == len(big)
    assert await until(lambda: r.demand.models[("static", "m")].in_flight == 0)
    assert r.demand.models[("static", "m")].output_tokens == 5


async def test_per_backend_connection_cap(world: Callable[..., Any]) -> None:
    eng = RawEngine(delay_s=0.5)
    _, url = await world([eng], RouterSettings(hold_timeout_s=5.0, max_backend_connections=2))
    results = await asyncio.gather(*(post(url, {"model": "m", "prompt": "x"}) for _ in range(5)))
    assert [st for st, _, _ in results] == [200] * 5
    assert len(eng.conns) <= 2, f"{len(eng.conns)} connections to one engine (cap 2)"


async def test_a_streamed_client_leaving_frees_the_engine_with_stub(world: Callable[..., Any]) -> None:
    hold = asyncio.Event()
    eng = StubEngine(name="s", hold=hold)
    _, url = await world([eng])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        resp.close()
    assert await until(lambda: bool(eng.seen) and eng.seen[0].disconnected)


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_non_streamed_answer_reaches_an_http10_client_whole(world: Callable[..., Any], chunked: bool) -> None:
    """Streamed through to an HTTP/1.0 client: the payload as is (with the engine's length, or delimited by
    close when the engine chunked it)."""
    big = json.dumps({"id": "x", "choices": [{"text": "z" * 300_000}], "usage": {"completion_tokens": 7}}).encode()
    eng = RawEngine(body=big, chunked=chunked)
    r, _ = await world([eng])
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    rd, w = await asyncio.open_connection("127.0.0.1", r.port)
    w.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))
    raw = await asyncio.wait_for(rd.read(), 10)  # to EOF: the router closes an HTTP/1.0 connection
    w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
    assert payload == big
    assert await until(lambda: r.demand.models[("static", "m")].output_tokens == 7)


async def test_a_busy_engine_that_answers_its_probe_is_waited_for(world: Callable[..., Any]) -> None:
    """Silence alone is not a hang: an engine slow to answer (a long queue, a long answer) but answering its
    /readyz probe keeps the request and stays in; nothing is sent twice."""
    eng = RawEngine(delay_s=1.5)
    r, url = await world([eng], RouterSettings(hold_timeout_s=2.0, first_byte_s=0.3, probe_timeout_s=0.5))
    st, _, body = await post(url, {"model": "m", "prompt": "x"})
    assert st == 200, body
    assert eng.requests() == 1 and eng.probes >= 2
    assert r.routes.backends[("static", "m")]["m-0"].usable(time.monotonic())


@pytest.mark.chaos
async def test_a_client_that_reads_nothing_holds_the_engine_back_not_the_routers_memory(
        world: Callable[..., Any]) -> None:
    """A slow client: the router stops reading from the engine once the client's buffer is full (TCP
    backpressure reaches the engine), instead of holding the answer; read later, it arrives whole."""
    big = b'{"text": "' + b"w" * (32 << 20) + b'"}'
    eng = RawEngine(body=big, chunked=True)
    r, _ = await world([eng])
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    rd, w = await asyncio.open_connection("127.0.0.1", r.port, limit=1 << 16)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"\r\n%s" % (len(body), body))
    await asyncio.sleep(1.5)  # the client reads nothing meanwhile
    held = eng.sent
    assert held < (24 << 20), f"the engine could send {held >> 20} MB to a client that read nothing"
    head = await rd.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    got, tail = 0, b""
    while not tail.endswith(b"\r\n0\r\n\r\n"):  # the engine's chunks, relayed as they are, then the terminator
        piece = await asyncio.wait_for(rd.read(1 << 20), 10)
        assert piece
        got += len(piece)
        tail = (tail + piece)[-16:]
    w.close()
    assert got > len(big) and eng.sent == len(big)


async def test_a_router_bug_answers_an_openai_error_naming_it(world: Callable[..., Any]) -> None:
    """aiohttp's own answer to a handler's exception is an HTML page, which OpenAI clients report as a bare
    "Error code: 500" (stop 46's killed-replica failure said no more than that); the router's is OpenAI-shaped,
    names the exception and the request id, and the next request is served."""
    eng = RawEngine()
    r, url = await world([eng])
    route = r.proxy._route

    async def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("deque mutated during iteration")

    r.proxy._route = broken
    st, h, body = await post(url, {"model": "m", "prompt": "x"})
    assert st == 500 and h["Content-Type"].startswith("application/json"), body
    err = json.loads(body)["error"]
    assert err["message"] == "router failed on this request: RuntimeError: deque mutated during iteration"
    assert err["type"] == "server_error" and len({k.lower(): v for k, v in h.items()}["x-request-id"]) == 32, h
    assert r.demand.models[("static", "m")].requests == {500: 1} and r.demand.models[("static", "m")].in_flight == 0
    r.proxy._route = route
    st, _, _ = await post(url, {"model": "m", "prompt": "x"})
    assert st == 200
