"""Issue 38, deadlines in the request path: a live pair's loading engine (B) waited 120 s for an answer of a hung
peer (A) before failing the step, with every request on the pair stalled meanwhile. It now waits a deadline
derived from A's measured answer times (PairClient.step_deadline), over a real TCP connection here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kascade_engine.live import pairclient
from kascade_engine.live.pairclient import PairClient
from kascade_engine.net.transport import TransportError
from kascade_engine.net.transport_tcp import TcpTransport


async def test_a_hung_peer_fails_the_step_at_the_measured_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pairclient, "STEP_DEADLINE_FLOOR_S", 0.5)
    answers = 5

    async def peer(conn: Any) -> None:  # A: answers the first steps at once, then hangs (reads, never answers)
        n = 0
        while True:
            await conn.recv(timeout=30)
            n += 1
            if n <= answers:
                await conn.send({"op": "tokens", "tokens": []}, timeout=5)

    listener = await TcpTransport().listen("127.0.0.1", 0, peer)
    conn = await TcpTransport().connect("127.0.0.1", listener.port)
    try:
        pc = PairClient(None, conn, asyncio.get_running_loop())  # type: ignore[arg-type]
        for _ in range(answers):
            reply, _ = await pc._exchange({"op": "step"}, b"")
            assert reply["op"] == "tokens"
        limit = pc.step_deadline()
        assert limit == max(0.5, 10 * max(pc.answer_s)) < 5  # fast answers: the floor, or 10 x the slowest
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            await asyncio.wait_for(pc._exchange({"op": "step"}, b""), 10)  # was: 120 s
        assert time.monotonic() - t0 < limit + 2
    finally:
        await conn.close()
        await listener.close()


def test_the_deadline_follows_slow_answers_and_is_capped() -> None:
    pc = PairClient(None, None, None, timeout=120.0)  # type: ignore[arg-type]
    assert pc.step_deadline() == pairclient.STEP_DEADLINE_FLOOR_S
    pc.answer_s.extend([0.1, 2.5, 0.2])  # a slow step (a long prompt's prefix on A) counts for the window
    assert pc.step_deadline() == pytest.approx(25.0)
    pc.answer_s.append(60.0)
    assert pc.step_deadline() == 120.0
