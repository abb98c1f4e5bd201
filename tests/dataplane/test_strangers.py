"""Idle unauthenticated connections ("strangers") on a data port must not cost a transfer (issue 38,
defect 3): they get a short handshake deadline and a pending cap of their own, and a new connection
evicts the oldest stranger instead of being refused, so plan participants always get in."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from typing import Any

from kascade_devcluster.ports import free_ports
from kascade_engine.net.admission import MAX_CONNECTIONS
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine


def _spec(blocks: BlockSet, timeout_s: float) -> TransferSpec:
    topo = leaf_spine(1, 2, 8)
    nodes = [x.name for x in topo.nodes]
    model = ModelLayout("tiny", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])], [Instance("t0", nodes[1])], "chain")
    ports = dict(zip(("s0", "t0"), free_ports(2), strict=True))
    return TransferSpec(plan, blocks.manifest(), {k: ("127.0.0.1", v) for k, v in ports.items()},
                        secrets.token_hex(16), 4096, timeout_s, {})


def _strangers(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    return socks


async def test_300_idle_strangers_on_both_data_ports_do_not_fail_a_transfer(tiny_blocks: BlockSet) -> None:
    """300 connections that never say a word sit on the target's and the source's data port (more than
    MAX_CONNECTIONS) before and while a real transfer runs: the transfer completes, every block
    verified, no downstream lost (before: the cap was full of strangers, the source's push to t0 was
    closed on accept, s0 recorded t0 lost and the transfer failed)."""
    n = MAX_CONNECTIONS + 44
    spec = _spec(tiny_blocks, 20.0)  # strangers used to be held for the whole plan timeout
    s0, t0 = TransferNode(spec, "s0", TcpTransport(), tiny_blocks), TransferNode(spec, "t0", TcpTransport())
    await t0.start()
    await s0.start()
    socks: list[socket.socket] = []
    try:
        for me in ("t0", "s0"):
            socks += await asyncio.to_thread(_strangers, spec.peers[me][1], n)
        await asyncio.sleep(0.3)  # all accepted by now: every one of them sits in its handshake
        started = time.monotonic()

        async def closed(node: TransferNode) -> dict[str, Any]:
            try:
                return await node.run()
            finally:
                await node.close()

        src, got = await asyncio.wait_for(asyncio.gather(closed(s0), closed(t0)), 15)
        assert got["resident"] == len(tiny_blocks.ids)
        assert all(t0.resident[b].verify() for b in tiny_blocks.ids)
        assert src["downstreamLost"] == {}, src["downstreamLost"]
        assert time.monotonic() - started < 10
    finally:
        for s in socks:
            s.close()


async def test_a_stranger_is_dropped_after_the_handshake_deadline() -> None:
    """A connection that never answers the challenge is closed within HANDSHAKE_TIMEOUT_S, not held for
    the caller's (plan's) timeout."""
    from kascade_engine.net import peerauth

    async def handler(conn) -> None:
        with contextlib.suppress(peerauth.AuthError):
            await peerauth.accept(conn, "t" * 32, "transfer", timeout=120)

    listener = await TcpTransport().listen("127.0.0.1", 0, handler)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", listener.port)
        started = time.monotonic()
        while await asyncio.wait_for(r.read(65536), peerauth.HANDSHAKE_TIMEOUT_S + 5):
            pass  # the challenge; then EOF when the server gives up on us
        assert time.monotonic() - started <= peerauth.HANDSHAKE_TIMEOUT_S + 1
        w.close()
    finally:
        await listener.close()


async def test_strangers_evict_only_strangers_never_an_admitted_peer() -> None:
    """MAX_PENDING + 10 strangers after a peer authenticated (through a paced listener, which must pass
    the admission on): the peer's connection still carries frames; the strangers were the ones evicted."""
    from kascade_engine.net import peerauth
    from kascade_engine.net.admission import MAX_PENDING
    from kascade_engine.net.pacing import paced

    token = secrets.token_hex(16)

    async def handler(conn) -> None:
        with contextlib.suppress(peerauth.AuthError):
            admitted = await peerauth.accept(conn, token, "transfer", timeout=10)
            await conn.send(admitted.welcome.header(), timeout=5)
            while True:
                header, _ = await conn.recv(timeout=30)
                await conn.send({"op": "echo", "n": header["n"]}, timeout=5)

    listener = await paced(TcpTransport(), 1e9).listen("127.0.0.1", 0, handler)
    peer = await TcpTransport().connect("127.0.0.1", listener.port)
    socks: list[socket.socket] = []
    try:
        await peerauth.join(peer, token, "transfer", timeout=5)
        socks = await asyncio.to_thread(_strangers, listener.port, MAX_PENDING + 10)
        await asyncio.sleep(0.3)
        await peer.send({"op": "ping", "n": 7}, timeout=5)
        header, _ = await peer.recv(timeout=5)
        assert header == {"op": "echo", "n": 7}
    finally:
        for s in socks:
            s.close()
        await peer.close()
        await listener.close()


def test_a_manifest_larger_than_the_bound_is_refused_naming_its_size(tiny_blocks: BlockSet) -> None:
    """A 1 TB manifest was accepted (a target then tried to reserve it); now a SpecError names the size."""
    import pytest

    from kascade_engine.net.transfer_spec import MAX_MANIFEST_BYTES, SpecError

    good = _spec(tiny_blocks, 5.0)
    huge = {b: dict(e) for b, e in good.manifest.items()}
    first = next(iter(huge))
    huge[first]["bytes"] = 10**12
    doc = {**good.to_dict(), "manifest": huge}
    with pytest.raises(SpecError, match=r"manifest totals 10000\d+ bytes .*more than the 512 GiB"):
        TransferSpec.from_dict(doc)
    huge[first]["bytes"] = -1
    with pytest.raises(SpecError, match=rf"manifest\.{first}\.bytes must be a non-negative integer"):
        TransferSpec.from_dict(doc)
    assert sum(e["bytes"] for e in good.manifest.values()) <= MAX_MANIFEST_BYTES
    assert TransferSpec.from_dict(good.to_dict()).manifest == good.manifest


def test_transfer_run_on_a_damaged_host_cache_is_a_clear_error(tmp_path: Any, tiny_blocks: BlockSet) -> None:
    """`kascade transfer run --cache <damaged>` ended in a traceback; now a one-line error naming the file."""
    import json

    from click.testing import CliRunner

    from kascade_cli.transfer import transfer

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(_spec(tiny_blocks, 5.0).to_dict()))
    bad = tmp_path / "bad.kcache"
    bad.write_bytes(b"KASCADE?" + (1 << 62).to_bytes(8, "little") + b"\0" * 64)
    r = CliRunner().invoke(transfer, ["run", "--spec", str(spec_file), "--me", "s0", "--cache", str(bad)])
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert f"--cache {bad}" in r.output and "Traceback" not in r.output, r.output


def test_a_symlink_loop_between_safetensors_files_is_a_clear_error(tmp_path: Any, harness: Any) -> None:
    """a.safetensors -> b.safetensors -> a.safetensors beside a real checkpoint's config ended packing in
    an OSError traceback."""
    import shutil

    import pytest

    from kascade_engine.weights.blocks import CheckpointError, pack_checkpoint

    real = harness.tiny_checkpoint(tmp_path / "real", layers=2, hidden=64)
    tmp_path = tmp_path / "looped"
    tmp_path.mkdir()
    shutil.copy(real / "config.json", tmp_path / "config.json")
    (tmp_path / "a.safetensors").symlink_to(tmp_path / "b.safetensors")
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"a\.safetensors: cannot be read \(.*symbolic links"):
        pack_checkpoint(tmp_path)
