"""The wire protocol's bad paths: malformed frames, wrong tokens, strangers; the server survives all."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import struct

import pytest

from kascade_engine.net import peerauth
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import SpecError, TransferSpec, shard_range
from kascade_engine.net.transport import (
    MAGIC,
    PREFIX,
    TransportError,
    decode_header,
    decode_prefix,
    encode_prefix,
)
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine


def test_frame_codec_limits() -> None:
    prefix, raw = encode_prefix({"op": "x"}, 10)
    assert decode_prefix(prefix) == (len(raw), 10)
    with pytest.raises(TransportError, match="bad frame magic"):
        decode_prefix(PREFIX.pack(b"HTTP", 1, 1))
    with pytest.raises(TransportError, match="too large"):
        decode_prefix(PREFIX.pack(MAGIC, 1 << 30, 0))
    with pytest.raises(TransportError, match="malformed header"):
        decode_header(b"[1, 2]")
    with pytest.raises(TransportError, match="malformed header"):
        decode_header(b"\xff\xfe")


def test_shard_ranges_tile_the_block() -> None:
    for size in (1, 7, 4096, 10**6 + 3):
        for g in (1, 2, 3, 8):
            ranges = [shard_range(size, (i, g)) for i in range(g)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def _spec(blocks: BlockSet, ports: dict[str, int]) -> TransferSpec:
    topo = leaf_spine(1, 3, 8)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("tiny", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])], [Instance("t0", nodes[1])], "chain")
    return TransferSpec(plan, blocks.manifest(), {k: ("127.0.0.1", v) for k, v in ports.items()}, secrets.token_hex(8),
                        64 << 10, 3.0)


def test_spec_errors_name_the_field(tiny_blocks: BlockSet) -> None:
    spec = _spec(tiny_blocks, {"s0": 1, "t0": 2})
    doc = spec.to_dict()
    with pytest.raises(SpecError, match="missing field 'token'"):
        TransferSpec.from_dict({k: v for k, v in doc.items() if k != "token"})
    with pytest.raises(SpecError, match=r"peers\.t0: expected host:port"):
        TransferSpec.from_dict({**doc, "peers": {**doc["peers"], "t0": "nowhere"}})
    with pytest.raises(SpecError, match="manifest lacks block 'head'"):
        TransferSpec.from_dict({**doc, "manifest": {k: v for k, v in doc["manifest"].items() if k != "head"}})
    with pytest.raises(SpecError, match="chunkBytes"):
        TransferSpec.from_dict({**doc, "chunkBytes": 12})
    with pytest.raises(SpecError, match=r"peers\.t0: port 99999 outside 1\.\.65535"):
        TransferSpec.from_dict({**doc, "peers": {**doc["peers"], "t0": "127.0.0.1:99999"}})
    for bad in (0, -1, 1e308, float("nan")):
        with pytest.raises(SpecError, match="timeoutSeconds must be within"):
            TransferSpec.from_dict({**doc, "timeoutSeconds": bad})
    assert TransferSpec.from_dict(doc) == spec


async def _closed_by_server(r: asyncio.StreamReader) -> bool:
    """The server dropped us (EOF, or a reset because it closed with our garbage unread) having sent
    nothing but its challenge (and perhaps an error): never a welcome."""
    try:
        return b"welcome" not in await asyncio.wait_for(r.read(), 5)
    except ConnectionResetError:
        return True


async def test_bad_clients_are_rejected_and_server_keeps_serving(tiny_blocks: BlockSet) -> None:
    from kascade_devcluster.ports import free_ports

    sp, tp = free_ports(2)
    spec = _spec(tiny_blocks, {"s0": sp, "t0": tp})
    transport = TcpTransport()
    source = TransferNode(spec, "s0", transport, tiny_blocks)
    await source.start()
    try:
        # 1. garbage bytes; 2. a frame with a bad header; 3. wrong token; 4. a stranger; 5. a push
        #    from a non-upstream peer -- each closes its own connection, nothing else.
        r, w = await asyncio.open_connection("127.0.0.1", sp)
        w.write(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
        await w.drain()
        assert await _closed_by_server(r)
        r, w = await asyncio.open_connection("127.0.0.1", sp)
        w.write(PREFIX.pack(MAGIC, 5, 0) + b"{oops")
        await w.drain()
        assert await _closed_by_server(r)
        replies = []
        for token, who, role in (("wrong", "t0", "pull"), (spec.token, "mallory", "pull"), (spec.token, "t0", "push")):
            conn = await transport.connect("127.0.0.1", sp)
            with pytest.raises(peerauth.AuthError) as refused:
                await peerauth.join(conn, token, "transfer", 5, **{"from": who, "role": role})
            replies.append(str(refused.value))
            await conn.close()
        assert replies[0].endswith("refused the hello: authentication failed")
        assert "mallory is not a pull peer" in replies[1]
        assert "t0 is not a push peer" in replies[2]
        # 6. an oversized length prefix is refused before any allocation.
        r, w = await asyncio.open_connection("127.0.0.1", sp)
        w.write(struct.pack("<4sIQ", MAGIC, 10, 1 << 40))
        await w.drain()
        assert await _closed_by_server(r)
        # After all that, a legitimate pull still gets every block, verified.
        target = TransferNode(spec, "t0", transport)
        await target.start()
        await target._refetch({(b, None) for b in tiny_blocks.ids})
        assert set(target.resident) == set(tiny_blocks.ids)
        assert all(target.resident[b].verify() for b in tiny_blocks.ids)
        await target.close()
    finally:
        await source.close()


async def test_a_fallback_with_a_bad_copy_fails_cleanly_instead_of_looping(tiny_blocks: BlockSet) -> None:
    from dataclasses import replace

    from kascade_devcluster.ports import free_ports
    from kascade_engine.net.recovery import TransferFailed

    sp, tp = free_ports(2)
    spec = _spec(tiny_blocks, {"s0": sp, "t0": tp})
    bad = dict(spec.manifest)
    bad["layer.1"] = {**bad["layer.1"], "digest": "0" * 64}  # no holder can ever match this
    spec = replace(spec, manifest=bad)
    transport = TcpTransport()
    source = TransferNode(spec, "s0", transport, tiny_blocks)
    target = TransferNode(spec, "t0", transport)
    await source.start()
    await target.start()
    try:
        with pytest.raises(TransferFailed, match=r"'layer\.1' still fails after 3 re-fetches"):
            await asyncio.wait_for(asyncio.gather(source.run(), target.run()), 30)
        assert target.corrupt_detected == 4  # the push, then three re-fetches
        assert "layer.1" not in target.resident and "layer.0" in target.resident
    finally:
        await target.close()
        await source.close()


async def test_ucx_same_host_uses_worker_address_fast_path() -> None:
    try:
        from kascade_engine.net.transport_ucx import FAST_MIN, UcxTransport
    except ImportError as e:
        from kascade_devcluster.requirement import unavailable

        unavailable(f"ucxx not importable: {e}")
    got: asyncio.Queue[tuple[dict[str, object], bytes, bool]] = asyncio.Queue()

    async def handler(conn: object) -> None:
        for _ in range(2):
            header, plen = await conn.recv_header(timeout=10)  # type: ignore[attr-defined]
            buf = bytearray(plen)
            await conn.recv_into(memoryview(buf), timeout=10)  # type: ignore[attr-defined]
            await got.put((header, bytes(buf), conn.fast_ep is not None))  # type: ignore[attr-defined]

    transport = UcxTransport(fast_path=True)
    listener = await transport.listen("127.0.0.1", 0, handler)
    conn = await transport.connect("127.0.0.1", listener.port)
    try:
        assert conn.fast_ep is not None  # type: ignore[attr-defined]  # same kernel, same netns
        big = secrets.token_bytes(FAST_MIN * 4)
        await conn.send({"op": "chunk", "n": 1}, big)  # over the worker-address endpoint
        await conn.send({"op": "chunk", "n": 2}, b"small")  # small payloads stay on the listener endpoint
        h1, p1, fast1 = await asyncio.wait_for(got.get(), 10)
        h2, p2, _ = await asyncio.wait_for(got.get(), 10)
        assert (h1, p1, fast1) == ({"op": "chunk", "n": 1}, big, True)  # the tag never leaks into headers
        assert (h2, p2) == ({"op": "chunk", "n": 2}, b"small")
    finally:
        await conn.close()
        await listener.close()


async def test_a_relay_closed_as_soon_as_run_returns_has_delivered_everything_downstream(tiny_blocks: BlockSet) -> None:
    """The engine closes its node right after `run()`; the tail of the chain must still get every block
    (run() waits for its writers, whatever other tasks the node keeps)."""
    from kascade_devcluster.ports import free_ports

    topo = leaf_spine(1, 3, 8)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("tiny", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])], [Instance("t0", nodes[1]), Instance("t1", nodes[2])],
                     "chain")
    assert plan.chains == (("s0", "t0", "t1"),)
    ports = dict(zip(("s0", "t0", "t1"), free_ports(3), strict=True))
    # t0 forwards slowly (test-only throttle): it has everything long before its writer has sent it.
    rate = tiny_blocks.total_bytes / 1.0 / 1e6
    spec = TransferSpec(plan, tiny_blocks.manifest(), {k: ("127.0.0.1", v) for k, v in ports.items()},
                        secrets.token_hex(8), 64 << 10, 5.0, {"t0": {"rateMBps": rate}})
    transport = TcpTransport()
    nodes_ = {"s0": TransferNode(spec, "s0", transport, tiny_blocks), "t0": TransferNode(spec, "t0", transport),
              "t1": TransferNode(spec, "t1", transport)}
    for n in nodes_.values():
        await n.start()

    async def run_then_close(node: TransferNode) -> dict[str, object]:
        try:
            return await node.run()
        finally:
            await node.close()

    results = await asyncio.wait_for(asyncio.gather(*(run_then_close(n) for n in nodes_.values())), 30)
    tail = results[2]
    assert tail["resident"] == len(tiny_blocks.ids) and tail["refetches"] == 0
    assert all(nodes_["t1"].resident[b].verify() for b in tiny_blocks.ids)


async def test_a_relay_whose_upstream_fails_while_a_downstream_holds_it_back_drops_that_downstream(
        tiny_blocks: BlockSet) -> None:
    """The upstream of a relay most likely dropped it as lagging when a downstream was holding it back (its
    queue full, the relay waiting on it much of the recent timeout): that downstream is dropped as lagging
    too, to re-fetch from its fallbacks, instead of being fed the relay's re-fetch at its slow pace. A
    downstream that was keeping up (queue not full, or little waiting) is kept."""
    import time

    from kascade_engine.net.forwarding import QUEUE_DEPTH

    topo = leaf_spine(1, 4, 8)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("tiny", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])],
                     [Instance(t, nodes[i + 1]) for i, t in enumerate(("t0", "t1", "t2"))], "chain")
    spec = TransferSpec(plan, tiny_blocks.manifest(), {k: ("127.0.0.1", 1) for k in ("s0", "t0", "t1", "t2")},
                        secrets.token_hex(8), 64 << 10, 4.0, {})
    for full, waited, dropped in ((True, 1.5, True), (True, 0.5, False), (False, 3.0, False)):
        relay = TransferNode(spec, "t1", TcpTransport())
        (d,) = relay.downstream
        for _ in range(QUEUE_DEPTH if full else 1):
            d.queue.put_nowait(({"op": "chunk"}, b""))
        d.waited_s, d.decay_at = waited, time.monotonic()
        relay._drop_what_held_us_back()
        assert (not d.alive) == dropped, (full, waited)
        assert ("t2" in relay.downstream_lost) == dropped
        if dropped:
            assert relay.downstream_lost["t2"].startswith("lagging: held this relay back")
    source = TransferNode(spec, "s0", TcpTransport(), tiny_blocks)  # a source has no upstream to be dropped by
    for _ in range(QUEUE_DEPTH):
        source.downstream[0].queue.put_nowait(({"op": "chunk"}, b""))
    source.downstream[0].waited_s = 3.0
    source._drop_what_held_us_back()
    assert source.downstream[0].alive
