"""Peer authentication (peerauth): the shared token never crosses the wire, a rogue listener learns
nothing it can use (no token, no replayable answer, no relayed session), a wrong token is refused with
a clear error on both sides, and a server that cannot prove the token is refused by the client.

Real TCP sockets, the real transfer node and the real activation-port handler; the rogue is a raw
asyncio server that records every byte it is sent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import pytest

from kascade_engine.net import peerauth
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.net.transport import PREFIX, Connection, decode_header, decode_prefix, encode_prefix
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

TOKEN = secrets.token_hex(32)


class Rogue:
    """A listener that is not a peer: it sends a challenge (or relays a real server's), records every
    byte it receives, and answers the hello with a forged welcome (or relays the real answer)."""

    def __init__(self, relay_to: int | None = None) -> None:
        self.seen = bytearray()
        self.hellos: list[dict[str, Any]] = []
        self.relay_to = relay_to
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _frame(self, r: asyncio.StreamReader) -> dict[str, Any]:
        prefix = await r.readexactly(PREFIX.size)
        hlen, _ = decode_prefix(prefix)
        raw = await r.readexactly(hlen)
        self.seen += prefix + raw
        return decode_header(raw)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            if self.relay_to is None:
                w.write(b"".join(encode_prefix(peerauth.Challenge(secrets.token_bytes(32)).header(), 0)))
                self.hellos.append(await self._frame(r))
                w.write(b"".join(encode_prefix({"op": "welcome", "proof": "0" * 64}, 0)))
            else:  # a man in the middle: the real server's challenge to the client, the client's hello back
                rr, rw = await asyncio.open_connection("127.0.0.1", self.relay_to)
                challenge = await rr.read(4096)
                w.write(challenge)
                hello = await self._frame(r)
                self.hellos.append(hello)
                rw.write(b"".join(encode_prefix(hello, 0)))
                w.write(await rr.read(4096))  # the server's verdict, passed on
            await w.drain()
            self.seen += await asyncio.wait_for(r.read(), 10)  # whatever the client sends afterwards
        w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def _activation_server(token: str) -> tuple[Any, list[dict[str, Any]]]:
    """A listener whose handler is the activation port's: accept, welcome, then echo one frame."""
    admitted: list[dict[str, Any]] = []

    async def handler(conn: Connection) -> None:
        with contextlib.suppress(peerauth.AuthError):
            a = await peerauth.accept(conn, token, "activation", timeout=10)
            admitted.append(a.claims)
            await conn.send(a.welcome.header(), timeout=10)
            await conn.send((await conn.recv(timeout=10, max_payload=0))[0], timeout=10)

    return await TcpTransport().listen("127.0.0.1", 0, handler), admitted


async def test_mutual_proof_admits_the_right_token_and_the_session_works() -> None:
    listener, admitted = await _activation_server(TOKEN)
    try:
        conn = await TcpTransport().connect("127.0.0.1", listener.port)
        claims = await peerauth.join(conn, TOKEN, "activation", timeout=10, role="pair")
        assert claims == {"role": "pair", "to": f"127.0.0.1:{listener.port}"} and admitted == [claims]
        await conn.send({"op": "ping"})
        assert (await conn.recv(timeout=10))[0] == {"op": "ping"}
        await conn.close()
    finally:
        await listener.close()


async def test_a_wrong_token_is_refused_with_a_clear_error_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    listener, admitted = await _activation_server(TOKEN)
    try:
        conn = await TcpTransport().connect("127.0.0.1", listener.port)
        with caplog.at_level(logging.WARNING, logger="kascade_engine.net.peerauth"), \
                pytest.raises(peerauth.AuthError, match=r"127\.0\.0\.1:\d+ refused the hello: authentication failed"):
            await peerauth.join(conn, "not-" + TOKEN, "activation", timeout=10)
        await conn.close()
        assert admitted == []
        assert "wrong proof: the peer does not hold this token" in caplog.text
        # the right token for another channel is a wrong proof here too
        conn = await TcpTransport().connect("127.0.0.1", listener.port)
        with pytest.raises(peerauth.AuthError, match="authentication failed"):
            await peerauth.join(conn, TOKEN, "transfer", timeout=10)
        await conn.close()
        assert admitted == []
    finally:
        await listener.close()


async def test_a_server_without_the_token_is_refused_by_the_client() -> None:
    """Mutual: a server that admits anyone and answers with a proof made from another token cannot
    prove it holds this one; the client stops before sending anything else."""
    after: list[bytes] = []

    async def lax(conn: Connection) -> None:
        nonce = secrets.token_bytes(peerauth.NONCE_BYTES)
        await conn.send(peerauth.Challenge(nonce).header(), timeout=10)
        hello = peerauth.Hello.parse((await conn.recv(timeout=10, max_payload=0))[0])
        made = peerauth.proof("another-installation", "server", "activation", nonce, hello.nonce, hello.claims)
        await conn.send(peerauth.Welcome(made).header(), timeout=10)
        with contextlib.suppress(Exception):
            after.append(bytes((await conn.recv(timeout=10))[0]["op"], "utf-8"))

    listener = await TcpTransport().listen("127.0.0.1", 0, lax)
    try:
        conn = await TcpTransport().connect("127.0.0.1", listener.port)
        with pytest.raises(peerauth.AuthError, match="could not prove it holds the token"):
            await peerauth.join(conn, TOKEN, "activation", timeout=10)
        await conn.close()
        assert after == []
    finally:
        await listener.close()


async def test_a_rogue_listener_learns_nothing_usable() -> None:
    """The client talks to a rogue: it never sends the token, it refuses the forged welcome (and sends
    nothing after it), and the answer the rogue captured is refused when replayed to a real server."""
    rogue = Rogue()
    port = await rogue.start()
    listener, admitted = await _activation_server(TOKEN)
    try:
        conn = await TcpTransport().connect("127.0.0.1", port)
        with pytest.raises(peerauth.AuthError, match=f"127.0.0.1:{port} could not prove it holds the token"):
            await peerauth.join(conn, TOKEN, "activation", timeout=10)
        await conn.close()
        assert len(rogue.hellos) == 1 and rogue.hellos[0]["op"] == "hello"
        await asyncio.sleep(0)
        for form in (TOKEN.encode(), TOKEN.encode().hex().encode(), bytes.fromhex(TOKEN)):
            assert form not in rogue.seen
        # Replay: the captured hello, sent to the real server, answers a challenge it never issued.
        r, w = await asyncio.open_connection("127.0.0.1", listener.port)
        hlen, _ = decode_prefix(await r.readexactly(PREFIX.size))
        assert decode_header(await r.readexactly(hlen))["op"] == "challenge"
        w.write(b"".join(encode_prefix(rogue.hellos[0], 0)))
        await w.drain()
        rest = await asyncio.wait_for(r.read(), 10)
        w.close()
        assert b"authentication failed" in rest and b"welcome" not in rest
        assert admitted == []
    finally:
        await rogue.close()
        await listener.close()


async def test_a_relayed_handshake_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A rogue relaying a real server's challenge and the client's answer gets no session: the proof
    names the rogue's address, the server's socket says another."""
    listener, admitted = await _activation_server(TOKEN)
    rogue = Rogue(relay_to=listener.port)
    port = await rogue.start()
    try:
        conn = await TcpTransport().connect("127.0.0.1", port)
        with caplog.at_level(logging.WARNING, logger="kascade_engine.net.peerauth"), \
                pytest.raises(peerauth.AuthError, match="refused the hello: authentication failed"):
            await peerauth.join(conn, TOKEN, "activation", timeout=10)
        await conn.close()
        assert admitted == []
        assert (
            f"proof made for 127.0.0.1:{port}, but this connection arrived at 127.0.0.1:{listener.port}" in caplog.text
        )
    finally:
        await rogue.close()
        await listener.close()


async def test_the_transfer_port_never_sees_the_plan_token_and_refuses_a_replay(tiny_blocks: BlockSet) -> None:
    """A real transfer node: a pull with the plan token is served after the challenge–response; the
    bytes of that exchange do not contain the token, and replaying the hello is refused."""
    from kascade_devcluster.ports import free_ports

    sp, tp = free_ports(2)
    topo = leaf_spine(1, 3, 8)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("tiny", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])], [Instance("t0", nodes[1])], "chain")
    spec = TransferSpec(plan, tiny_blocks.manifest(), {"s0": ("127.0.0.1", sp), "t0": ("127.0.0.1", tp)}, TOKEN,
                        64 << 10, 10.0)
    source = TransferNode(spec, "s0", TcpTransport(), tiny_blocks)
    await source.start()
    rogue = Rogue(relay_to=sp)  # a tap: relays, so it sees the whole exchange (and is refused for it)
    rport = await rogue.start()
    try:
        conn = await TcpTransport().connect("127.0.0.1", rport)
        with pytest.raises(peerauth.AuthError, match="authentication failed"):
            await peerauth.join(conn, TOKEN, "transfer", 10, **{"from": "t0", "role": "pull"})
        await conn.close()
        assert rogue.hellos and TOKEN.encode() not in rogue.seen
        # the real thing still works: a pull straight to the source gets every block, verified
        target = TransferNode(spec, "t0", TcpTransport())
        await target.start()
        await target._refetch({(b, None) for b in tiny_blocks.ids})
        assert set(target.resident) == set(tiny_blocks.ids)
        await target.close()
    finally:
        await rogue.close()
        await source.close()


def test_proofs_are_bound_to_side_context_nonces_and_claims() -> None:
    n1, n2 = b"\1" * 32, b"\2" * 32
    base = peerauth.proof(TOKEN, "client", "activation", n1, n2, {"to": "a:1"})
    assert len(base) == 64 and base == peerauth.proof(TOKEN, "client", "activation", n1, n2, {"to": "a:1"})
    others = [peerauth.proof(TOKEN, "server", "activation", n1, n2, {"to": "a:1"}),
              peerauth.proof(TOKEN, "client", "transfer", n1, n2, {"to": "a:1"}),
              peerauth.proof(TOKEN, "client", "activation", n2, n2, {"to": "a:1"}),
              peerauth.proof(TOKEN, "client", "activation", n1, n1, {"to": "a:1"}),
              peerauth.proof(TOKEN, "client", "activation", n1, n2, {"to": "a:2"}),
              peerauth.proof("x" + TOKEN, "client", "activation", n1, n2, {"to": "a:1"})]
    assert base not in others and len(set(others)) == len(others)
    assert peerauth.normal_address("::ffff:10.0.0.5:7000") == "10.0.0.5:7000"
    assert peerauth.normal_address("10.0.0.5:7000") == "10.0.0.5:7000"


@pytest.mark.parametrize(("header", "message"), [
    ({"op": "hello"}, "expected a challenge"),
    ({"op": "challenge", "v": 2, "nonce": "00" * 32}, "peerauth version 2"),
    ({"op": "challenge", "v": 1, "nonce": "zz" * 32}, "field 'nonce' is not hex"),
    ({"op": "challenge", "v": 1, "nonce": "00"}, "field 'nonce' must be 64 hex characters"),
])
def test_a_malformed_challenge_is_named(header: dict[str, Any], message: str) -> None:
    with pytest.raises(peerauth.AuthError, match=message):
        peerauth.Challenge.parse(header)


@pytest.mark.parametrize(("header", "message"), [
    ({"op": "hello", "token": TOKEN}, "field 'claims' must be an object"),
    ({"op": "hello", "claims": {}, "nonce": "00" * 32, "proof": "short"}, "field 'proof' must be 64 hex"),
    ({"op": "hello", "claims": {}, "nonce": "00" * 31, "proof": "00" * 32}, "field 'nonce' must be 64 hex"),
])
def test_a_malformed_hello_is_named(header: dict[str, Any], message: str) -> None:
    with pytest.raises(peerauth.AuthError, match=message):
        peerauth.Hello.parse(header)


async def test_a_relayed_handshake_is_refused_over_ucx_too(caplog: pytest.LogCaptureFixture) -> None:
    """The same relay over UCX (a decode engine dials the prefill address a request names, over --transport
    ucx too): the accepted UCX connection knows the address the client reached, so the server refuses a
    proof made for the rogue's address, and the client sends nothing after the refused hello."""
    try:
        from kascade_engine.net.transport_ucx import UcxTransport
    except ImportError as e:
        from kascade_devcluster.requirement import unavailable

        unavailable(f"ucxx not importable: {e}")
    ucx = UcxTransport()
    admitted: list[dict[str, Any]] = []

    async def server(conn: Connection) -> None:
        with contextlib.suppress(peerauth.AuthError):
            a = await peerauth.accept(conn, TOKEN, "activation", timeout=10)
            admitted.append(a.claims)
            await conn.send(a.welcome.header(), timeout=10)
            await conn.recv(timeout=10, max_payload=0)

    real = await ucx.listen("127.0.0.1", 0, server)
    after_hello: list[dict[str, Any]] = []

    async def relay(conn: Connection) -> None:  # the rogue: the real server's frames to the client and back
        with contextlib.suppress(Exception):
            up = await ucx.connect("127.0.0.1", real.port)
            await conn.send((await up.recv(timeout=10, max_payload=0))[0], timeout=10)  # challenge
            await up.send((await conn.recv(timeout=10, max_payload=0))[0], timeout=10)  # hello
            await conn.send((await up.recv(timeout=10, max_payload=0))[0], timeout=10)  # verdict
            after_hello.append((await conn.recv(timeout=3))[0])  # what the client sends next, if anything
            await up.close()

    rogue = await ucx.listen("127.0.0.1", 0, relay)
    try:
        # first the direct session works over UCX, with the address check on (claims name the real port)
        conn = await ucx.connect("127.0.0.1", real.port)
        claims = await peerauth.join(conn, TOKEN, "activation", timeout=10)
        assert claims == {"to": f"127.0.0.1:{real.port}"} and admitted == [claims]
        await conn.close()
        conn = await ucx.connect("127.0.0.1", rogue.port)
        with caplog.at_level(logging.WARNING, logger="kascade_engine.net.peerauth"), \
                pytest.raises(peerauth.AuthError, match="refused the hello: authentication failed"):
            await peerauth.join(conn, TOKEN, "activation", timeout=10)
        await conn.close()
        assert len(admitted) == 1 and after_hello == []
        assert (f"proof made for 127.0.0.1:{rogue.port}, but this connection arrived at 127.0.0.1:{real.port}"
                in caplog.text)
    finally:
        await rogue.close()
        await real.close()
