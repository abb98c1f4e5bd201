"""Transports under stress of the peer: one that stops reading, and UCX fast-path connections that
share a worker-address endpoint and close while the other's payload is in flight."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pytest

from kascade_devcluster.ports import free_ports
from kascade_engine.net.transport import Transport, TransportError
from kascade_engine.net.transport_tcp import TcpTransport


def _ucx(fast_path: bool) -> Any:
    try:
        from kascade_engine.net.transport_ucx import UcxTransport
    except ImportError as e:
        from kascade_devcluster.requirement import unavailable

        unavailable(f"ucxx not importable: {e}")
    return UcxTransport(fast_path=fast_path)


def _transport(name: str) -> Transport:
    return TcpTransport() if name == "tcp" else _ucx(fast_path=name == "ucx-fast")


@pytest.mark.parametrize("name", ["tcp", "ucx", "ucx-fast"])
async def test_a_peer_that_reads_nothing_fails_the_send_at_its_timeout(name: str) -> None:
    transport = _transport(name)
    headers: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    async def stalled(conn: Any) -> None:
        header, _ = await conn.recv_header(timeout=10)
        await headers.put(header)
        await asyncio.sleep(30)  # alive, never reads the payload

    listener = await transport.listen("127.0.0.1", 0, stalled)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"took nothing for 1\.0 s"):
            await conn.send({"op": "chunk", "n": 1}, bytes(64 << 20), timeout=1.0)  # more than any socket buffer
        assert 0.9 < time.monotonic() - t0 < 5
        assert (await asyncio.wait_for(headers.get(), 5))["n"] == 1
    finally:
        await conn.close()
        await listener.close()


@pytest.mark.parametrize("name", ["tcp", "ucx"])
async def test_a_connect_nobody_answers_fails_at_once_not_at_its_timeout(name: str) -> None:
    """Peers start concurrently: a source dials its downstream before that one listens and retries until the
    plan's timeout (forwarding.py `_connect_retrying`). `ucxx.create_endpoint` waits out its peer-info timeout
    (5 s by default, the caller's when given) even after UCP reported the refusal, so one attempt spent the
    source's whole budget (a clean 1->1 UCX transfer re-fetched everything). A refusal must fail in a blink:
    1-23 ms here at load 5-12 (a process's first UCX endpoint took 0.8 s to create at load 28), 5.0 s through
    ucxx's own call: 2.5 s tells them apart under any load seen here."""
    transport = _transport(name)
    port = free_ports(1)[0]
    for _ in range(2):  # the first connect of a process also pays UCX's first wireup: both must be quick
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
            await transport.connect("127.0.0.1", port, timeout=30.0)
        assert time.monotonic() - t0 < 2.5


async def test_ucx_fast_path_connections_share_one_endpoint_and_outlive_each_other() -> None:
    transport = _ucx(fast_path=True)
    from kascade_engine.net.transport_ucx import FAST_MIN

    received: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    first_closed = asyncio.Event()

    async def handler(conn: Any) -> None:
        header, plen = await conn.recv_header(timeout=10)
        if header["n"] == 2:
            await first_closed.wait()  # post this receive only once the other connection is gone
        buf = bytearray(plen)
        await conn.recv_into(memoryview(buf), timeout=10)
        await received.put((int(header["n"]), bytes(buf)))

    listener = await transport.listen("127.0.0.1", 0, handler)
    a = await transport.connect("127.0.0.1", listener.port)
    b = await transport.connect("127.0.0.1", listener.port)
    try:
        assert a.fast_ep is not None and a.fast_ep is b.fast_ep
        one, two = secrets.token_bytes(FAST_MIN * 8), secrets.token_bytes(FAST_MIN * 8)
        in_flight = asyncio.create_task(b.send({"op": "chunk", "n": 2}, two, timeout=10))
        await a.send({"op": "chunk", "n": 1}, one, timeout=10)
        assert await asyncio.wait_for(received.get(), 10) == (1, one)
        await a.close()
        await asyncio.sleep(0.2)  # the server side of `a` closes too
        first_closed.set()
        await asyncio.wait_for(in_flight, 10)
        assert await asyncio.wait_for(received.get(), 10) == (2, two)
    finally:
        await b.close()
        await listener.close()


async def test_ucx_waiting_for_a_frame_leaves_the_event_loop_idle_and_notices_it_soon() -> None:
    """A receive posted with nothing to receive (a relay waiting for its upstream's next frame, or for a
    peer that stalled) must not spin its event loop: ucxx's own wait did (`await asyncio.sleep(0)` until
    done), ~0.9 s of this thread's CPU per second waited (240,000 loop iterations/s) in every process of a
    chain, which starved the nodes with work on a loaded 2-core host. The frame is still noticed promptly."""
    transport = _ucx(fast_path=False)
    got: asyncio.Queue[tuple[float, dict[str, object]]] = asyncio.Queue()

    async def waiting(conn: Any) -> None:
        header, _ = await conn.recv_header(timeout=10)
        await got.put((time.monotonic(), header))

    listener = await transport.listen("127.0.0.1", 0, waiting)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        await asyncio.sleep(0.2)  # the listener's handler is now waiting in recv_header
        cpu, wall = time.thread_time(), time.monotonic()
        await asyncio.sleep(1.0)
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        assert cpu < 0.2 * wall, f"the event loop's thread used {cpu:.2f} s of CPU in {wall:.2f} s of waiting"
        sent = time.monotonic()
        await conn.send({"op": "chunk", "n": 7}, timeout=5)
        at, header = await asyncio.wait_for(got.get(), 5)
        assert header["n"] == 7 and at - sent < 0.25, f"noticed {at - sent:.3f} s after it was sent"
    finally:
        await conn.close()
        await listener.close()


async def test_ucx_a_receive_abandoned_at_its_timeout_is_kept_until_ucx_completes_it() -> None:
    """A receive whose timeout expired is still posted in UCX. Destroying its ucxx request then (dropping the
    timeout's exception was enough) cancels it from the event loop's thread while UCX's progress thread can
    be completing it: the two take the request's and the worker's locks in opposite orders, and a chain
    node hung for good (ADR 0012). The transport keeps such a request alive until
    UCX has completed it (the endpoint's close cancels it), and only then lets it go."""
    import gc

    from kascade_engine.net import ucxrequest

    transport = _ucx(fast_path=False)
    timed_out = asyncio.Event()

    async def waiting(conn: Any) -> None:
        with pytest.raises(TransportError, match="no data"):
            await conn.recv_header(timeout=0.3)
        timed_out.set()
        await asyncio.sleep(30)

    before = ucxrequest.in_flight()
    listener = await transport.listen("127.0.0.1", 0, waiting)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        await asyncio.wait_for(timed_out.wait(), 5)
        gc.collect()  # the exception and its frames are gone: only the transport holds the request
        assert ucxrequest.in_flight() == before + 1
    finally:
        await conn.close()
        await listener.close()
    deadline = time.monotonic() + 5  # the listener side's endpoint is closed by its peer's close
    while ucxrequest.in_flight() > before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert ucxrequest.in_flight() == before
