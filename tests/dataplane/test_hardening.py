"""Recovery paths end, and nothing is allocated for a stranger: a downstream that lags is dropped (named)
while its upstream keeps going, a source whose only downstream dies finishes, a task that fails ends the
transfer with its name, and a hello that announces a payload is refused before one byte is allocated,
on the data port and on the activation port. Each of these hung or allocated before the fix."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kascade_devcluster.ports import free_ports
from kascade_engine.net.relay import TransferFailed, TransferNode
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.net.transport import MAGIC, PREFIX, Connection, TransportError, encode_prefix
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import leaf_spine

T = 2.0  # timeoutSeconds of these transfers


@pytest.fixture(scope="module")
def big_blocks() -> BlockSet:
    """24 MiB of random blocks: more than socket buffers and a downstream queue hold together."""
    from kascade_engine.weights.blocks import Block, digest_of

    data = {b: memoryview(bytearray(secrets.token_bytes(6 << 20))) for b in ("embed", "layer.0", "layer.1", "head")}
    return BlockSet("tiny", {}, (Block(b, v, (), digest_of(v)) for b, v in data.items()))


def _chain(blocks: BlockSet, n: int) -> Plan:
    topo = leaf_spine(1, n + 1, 8)
    nodes = [x.name for x in topo.nodes]
    model = ModelLayout("tiny", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    return make_plan(topo, model, [Instance("s0", nodes[0])], [Instance(f"t{i}", nodes[i + 1]) for i in range(n)],
                     "chain")


def _spec(blocks: BlockSet, n: int, faults: dict[str, Any] | None = None) -> TransferSpec:
    plan = _chain(blocks, n)
    ids = ["s0", *(f"t{i}" for i in range(n))]
    ports = dict(zip(ids, free_ports(len(ids)), strict=True))
    # 4 KiB chunks: a block is far more frames than a downstream queue holds.
    return TransferSpec(plan, blocks.manifest(), {k: ("127.0.0.1", v) for k, v in ports.items()},
                        secrets.token_hex(16), 4096, T, faults or {})


async def _fake_downstream(spec: TransferSpec, me: str, behave: Callable[[Connection], Awaitable[None]]) -> Any:
    """A peer that authenticates like a real one and then misbehaves as told."""

    from kascade_engine.net import peerauth

    async def handler(conn: Connection) -> None:
        admitted = await peerauth.accept(conn, spec.token, "transfer", timeout=10)
        await conn.send(admitted.welcome.header())
        await behave(conn)

    return await TcpTransport().listen("127.0.0.1", spec.peers[me][1], handler)


async def _run_closed(node: TransferNode) -> dict[str, Any]:
    try:
        return await node.run()
    finally:
        await node.close()


async def test_a_lagging_downstream_is_dropped_by_name_and_the_node_keeps_going(big_blocks: BlockSet) -> None:
    """s0 -> t0 -> t1 where t1 reads one frame every 50 ms: t0 must not lose its upstream (it did: a
    full queue raised QueueFull in its receive loop and the transfer hung); it drops t1, finishes."""
    tiny_blocks = big_blocks
    spec = _spec(tiny_blocks, 2)

    async def crawl(conn: Connection) -> None:
        while True:
            await conn.recv(timeout=30)
            await asyncio.sleep(0.05)

    slow = await _fake_downstream(spec, "t1", crawl)
    s0, t0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks), TransferNode(spec, "t0", TcpTransport())
    await s0.start()
    await t0.start()
    try:
        t_start = time.monotonic()
        src, first = await asyncio.wait_for(asyncio.gather(_run_closed(s0), _run_closed(t0)), 6 * T)
        assert first["resident"] == len(tiny_blocks.ids)
        assert all(t0.resident[b].verify() for b in tiny_blocks.ids)
        assert "lagging" in first["downstreamLost"]["t1"], first["downstreamLost"]
        assert src["downstreamLost"] == {}  # t0 kept reading its upstream throughout
        assert time.monotonic() - t_start < 4 * T
    finally:
        await slow.close()


async def test_a_source_whose_only_downstream_dies_finishes(big_blocks: BlockSet) -> None:
    """The source's feeder blocked forever on the dead downstream's full queue; now run() returns."""
    tiny_blocks = big_blocks
    spec = _spec(tiny_blocks, 1)

    async def die_after_a_few(conn: Connection) -> None:
        for _ in range(5):
            await conn.recv(timeout=10)
        await conn.close()

    dying = await _fake_downstream(spec, "t0", die_after_a_few)
    s0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks)
    port = await s0.start()
    try:
        summary = await asyncio.wait_for(_run_closed(s0), 4 * T)
        assert "t0" in summary["downstreamLost"]
        # ... and its listener is closed: the port can be listened on again (a later load-plan).
        again = await TcpTransport().listen("127.0.0.1", port, lambda c: c.close())
        await again.close()
    finally:
        await dying.close()


async def test_a_failing_task_ends_the_transfer_with_its_name(
    tiny_blocks: BlockSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification that raises (here: the block verifier's check) used to die silently, leaving the
    node 'loading' forever; now run() raises TransferFailed naming the task and the error."""
    import kascade_engine.net.relay as relay

    def broken() -> bool:
        raise RuntimeError("digest unit on fire")

    monkeypatch.setattr(relay.BlockVerifier, "seal", lambda self: broken)
    spec = _spec(tiny_blocks, 1)
    s0, t0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks), TransferNode(spec, "t0", TcpTransport())
    await s0.start()
    await t0.start()
    try:
        with pytest.raises(TransferFailed, match=r"t0: verification of \S+ failed: RuntimeError: digest unit on fire"):
            await asyncio.wait_for(t0.run(), 4 * T)
    finally:
        await t0.close()
        await s0.close()


async def _announce_and_wait(port: int, token: str, context: str, claims: dict[str, Any],
                             payload_len: int) -> tuple[float, bytes]:
    """Read the server's challenge, answer it with a hello (a valid proof for `token`) that announces
    `payload_len` bytes (and sends none of them); returns how long until the server answered or closed,
    and everything it sent after the challenge."""
    from kascade_engine.net import peerauth
    from kascade_engine.net.transport import decode_header, decode_prefix

    r, w = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    hlen, _ = decode_prefix(await asyncio.wait_for(r.readexactly(PREFIX.size), 10))
    challenge = peerauth.Challenge.parse(decode_header(await r.readexactly(hlen)))
    mine = secrets.token_bytes(peerauth.NONCE_BYTES)
    claims = {**claims, "to": f"127.0.0.1:{port}"}
    hello = peerauth.Hello(mine, peerauth.proof(token, "client", context, challenge.nonce, mine, claims), claims)
    prefix, raw = encode_prefix(hello.header(), 0)
    assert prefix[:4] == MAGIC
    w.write(PREFIX.pack(MAGIC, len(raw), payload_len) + raw)
    await w.drain()
    try:
        got = await asyncio.wait_for(r.read(), 10)  # until the server closes
    except (ConnectionResetError, TimeoutError):
        got = b""
    w.close()
    return time.monotonic() - t0, got


async def _held_bytes_while(conns: Callable[[], Awaitable[Any]]) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        task = asyncio.create_task(conns())
        peak = 0
        while not task.done():
            peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
            await asyncio.sleep(0.02)
        await task
        return max(peak, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()


async def test_data_port_allocates_nothing_before_the_hello_is_checked(tiny_blocks: BlockSet) -> None:
    spec = _spec(tiny_blocks, 1)
    s0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks)
    port = await s0.start()
    try:
        # Even a hello with the right token may not carry a payload: it is refused at once, unread.
        claims = {"from": "t0", "role": "pull"}
        results: list[tuple[float, bytes]] = []

        async def flood() -> None:
            results.extend(await asyncio.gather(*(_announce_and_wait(port, tok, "transfer", claims, 64 << 20)
                                                  for tok in ("wrong", spec.token) * 4)))

        held = await _held_bytes_while(flood)
        assert held < 16 << 20, f"{held / 2**20:.0f} MiB allocated for 8 unauthenticated 64 MiB announcements"
        for took, got in results:
            assert took < T / 2  # answered, not left waiting for a payload that never comes
            assert b"authentication failed" in got and b"welcome" not in got
    finally:
        await s0.close()


async def test_activation_port_allocates_nothing_before_the_hello_is_checked() -> None:
    from kascade_engine.live.split import Finisher

    # The model is never reached before authentication: a stand-in with a shape is enough here.
    finisher = Finisher(SimpleNamespace(shape=SimpleNamespace(hidden=64, layers=2)), token="s3cret")  # type: ignore[arg-type]
    listener = await TcpTransport().listen("127.0.0.1", 0, finisher.handle)
    try:
        results: list[tuple[float, bytes]] = []

        async def flood() -> None:
            results.extend(await asyncio.gather(*(
                _announce_and_wait(listener.port, tok, "activation", {}, 64 << 20) for tok in ("wrong", "s3cret") * 4)))

        held = await _held_bytes_while(flood)
        assert held < 16 << 20, f"{held / 2**20:.0f} MiB allocated for 8 unauthenticated 64 MiB announcements"
        for took, got in results:  # refused at once, and closed
            assert took < 5 and b"authentication failed" in got and b"welcome" not in got
    finally:
        await listener.close()


def _other_local_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


async def test_ucx_listens_only_on_the_named_host() -> None:
    try:
        from kascade_engine.net.transport_ucx import UcxTransport
    except ImportError as e:
        from kascade_devcluster.requirement import unavailable

        unavailable(f"ucxx not importable: {e}")
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to reach the listener on")
    served: list[str] = []

    async def handler(conn: Any) -> None:
        hdr, _ = await conn.recv(timeout=5, max_payload=0)
        served.append(str(hdr["op"]))
        await conn.send({"op": "welcome"})

    transport = UcxTransport()
    listener = await transport.listen("127.0.0.1", 0, handler)
    try:
        with pytest.raises(TransportError):
            conn = await transport.connect(other, listener.port, timeout=3)
            await conn.send({"op": "hello"}, timeout=3)
            await conn.recv(timeout=3)
        ok = await transport.connect("127.0.0.1", listener.port, timeout=5)
        await ok.send({"op": "hello"}, timeout=5)
        assert (await ok.recv(timeout=5))[0] == {"op": "welcome"}
        await ok.close()
        assert served == ["hello"]  # the connection on the other address never reached the handler
    finally:
        await listener.close()


async def test_a_plan_token_derived_from_the_scaleplan_is_refused(tiny_blocks: BlockSet) -> None:
    """The operator gives each plan a secret keyed by the installation's engine token; the old token
    (`<ScalePlan name>-<uid>`, readable by anyone who can read ScalePlans) no longer authenticates."""
    from kascade_operator.engine_client import EngineClient

    name, uid = "svc-decode-x7k2p", "5b0c8f7e-3f6e-4c2a-9d1e-0a4b6c8d2e1f"
    secret = EngineClient("installation-token").plan_secret("default", name, uid)
    assert secret != EngineClient("another-installation").plan_secret("default", name, uid)
    assert name not in secret and uid not in secret and len(secret) == 64
    from dataclasses import replace

    from kascade_engine.net import peerauth

    spec = replace(_spec(tiny_blocks, 1), token=secret)
    s0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks)
    port = await s0.start()
    try:
        replies = []
        for token in (f"{name}-{uid}", name, uid, secret):
            conn = await TcpTransport().connect("127.0.0.1", port)
            try:
                await peerauth.join(conn, token, "transfer", 5, **{"from": "t0", "role": "pull"})
                replies.append("welcome")
            except peerauth.AuthError as e:
                assert "refused the hello: authentication failed" in str(e)
                replies.append("error")
            await conn.close()
        assert replies == ["error", "error", "error", "welcome"]
    finally:
        await s0.close()


def test_a_damaged_host_cache_is_a_clear_error(tmp_path: Any, tiny_blocks: BlockSet) -> None:
    import json as _json

    from kascade_engine.weights.blocks import CheckpointError
    from kascade_engine.weights.hostcache import MAGIC as CACHE_MAGIC
    from kascade_engine.weights.hostcache import open_cache, write_cache

    good = tmp_path / "good.kcache"
    write_cache(good, tiny_blocks)
    raw = good.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    header = _json.loads(raw[16:16 + n])
    cases = {
        "length": CACHE_MAGIC + (1 << 62).to_bytes(8, "little") + raw[16:],  # a huge read before the fix
        "not-json": raw[:16] + b"\xff" * n + raw[16 + n:],
        "no-blocks": raw[:16] + _json.dumps({"model": "m"}).encode().ljust(n) + raw[16 + n:],
        "entry": raw[:16] + _json.dumps({**header, "blocks": [{"id": "embed"}]}).encode().ljust(n) + raw[16 + n:],
        "negative": raw[:16] + _json.dumps({**header, "blocks": [{**header["blocks"][0], "offset": -4096}]}
                                           ).encode().ljust(n) + raw[16 + n:],
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name}.kcache"
        bad.write_bytes(data)
        with pytest.raises(CheckpointError, match=rf"{name}\.kcache: (corrupt header|block entry 0 is damaged)"):
            open_cache(bad)


def test_absurd_config_integers_are_refused_before_any_allocation() -> None:
    from kascade_engine.batch.families import FamilyError, expected_shapes

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    for layers, msg in ((10**9, "outside 1..1024"), (0, "outside"), (2.5, "must be an integer"), ("4", "integer")):
        with pytest.raises(FamilyError, match=rf"num_hidden_layers.*{msg}"):
            expected_shapes({**cfg, "num_hidden_layers": layers})
    assert len(expected_shapes({**cfg, "num_hidden_layers": 2})) > 2


async def test_a_tcp_relay_verifies_chunks_as_they_land(tiny_blocks: BlockSet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP (paced or not) a receiver hashes each chunk right after its read, so the commit check
    never re-reads a whole block: with the whole-buffer digest broken the transfer still completes, every
    chunk went through a verifier, and the verified blocks equal the source's. UCX lands chunks from its
    progress thread and keeps the check at commit."""
    import kascade_engine.net.relay as relay
    from kascade_engine.net.pacing import paced
    from kascade_engine.net.transport_ucx import UcxTransport

    assert TcpTransport.hash_on_landing and paced(TcpTransport(), 1e9).hash_on_landing
    assert not UcxTransport.hash_on_landing

    def whole_buffer(data: object, digest: str) -> bool:
        raise AssertionError("a whole block was re-hashed at commit")

    landed: list[int] = []
    real_landed = relay.BlockVerifier.landed

    def counting(self: Any, offset: int, length: int) -> Any:
        landed.append(length)
        return real_landed(self, offset, length)

    monkeypatch.setattr(relay, "digest_matches", whole_buffer)
    monkeypatch.setattr(relay.BlockVerifier, "landed", counting)
    spec = _spec(tiny_blocks, 1)
    s0, t0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks), TransferNode(spec, "t0", TcpTransport())
    await s0.start()
    await t0.start()
    try:
        await asyncio.wait_for(asyncio.gather(s0.run(), t0.run()), 4 * T)
    finally:
        await t0.close()
        await s0.close()
    assert sum(landed) == sum(b.nbytes for b in tiny_blocks.blocks.values())
    assert set(t0.resident) == set(tiny_blocks.ids)
    assert all(bytes(t0.resident[b].data) == bytes(tiny_blocks.blocks[b].data) for b in tiny_blocks.ids)
