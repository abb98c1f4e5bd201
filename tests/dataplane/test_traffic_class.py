"""Traffic classes: the engine's activation connections carry the DSCP mark (IP TOS, SO_PRIORITY) at both
ends, over plain TCP and TLS, while its weight connections carry none; `--activation-dscp 0` turns the mark
off and a bad value names the flag. And the benchmarks' emulated links (bench/netlab.py) send the marked
class through their activation htb class, everything else through bulk (read from tc's class counters)."""

from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kascade_engine.config import ConfigError, EngineConfig
from kascade_engine.net.transport import ACTIVATION, AF41, Connection, TrafficClass, Transport
from kascade_engine.net.transport_tcp import TcpConnection, TcpTransport
from kascade_engine.net.transport_tls import TlsConnection, TlsFiles, TlsTransport

ECN = 0x03  # the TOS byte's two low bits belong to ECN, not to the class


def _sock(conn: Connection) -> Any:
    if isinstance(conn, TcpConnection):
        return conn.sock
    assert isinstance(conn, TlsConnection)
    return conn.writer.get_extra_info("socket")


def _mark(conn: Connection) -> tuple[int, int]:
    """(TOS without ECN bits, SO_PRIORITY) of a connection's socket, as the kernel reports them."""
    s = _sock(conn)
    return (s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) & ~ECN,
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY))


async def _both_ends(transport: Transport) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (TOS, priority) of a connection's connecting end and of its accepted end."""
    accepted: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

    async def handler(conn: Connection) -> None:
        accepted.set_result(_mark(conn))
        await conn.recv(timeout=5)  # the client's frame: the stream works with the mark

    lst = await transport.listen("127.0.0.1", 0, handler)
    try:
        conn = await transport.connect("127.0.0.1", lst.port)
        try:
            client = _mark(conn)
            await conn.send({"op": "ping"}, b"x" * 1000)
            server = await asyncio.wait_for(accepted, 5)
        finally:
            await conn.close()
    finally:
        await lst.close()
    return client, server


def _config(tmp_path: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(tmp_path, "m", "token", **kw)


async def test_activation_connections_carry_the_mark_at_both_ends_and_weight_connections_none(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert cfg.activation_dscp == AF41
    want = (0x88, ACTIVATION.priority)
    assert await _both_ends(cfg.activation_transport()) == (want, want)
    assert await _both_ends(cfg.weight_transport()) == ((0, 0), (0, 0))


async def test_activation_dscp_zero_leaves_the_act_port_unmarked_and_another_class_is_used_as_given(
    tmp_path: Path,
) -> None:
    assert await _both_ends(_config(tmp_path, activation_dscp=0).activation_transport()) == ((0, 0), (0, 0))
    ef = 46  # DSCP EF: TOS 0xb8
    assert await _both_ends(_config(tmp_path, activation_dscp=ef).activation_transport()) == (
        (0xB8, ACTIVATION.priority),
        (0xB8, ACTIVATION.priority),
    )


async def test_tls_activation_connections_carry_the_mark_too(pki: dict[str, Path]) -> None:
    files = TlsFiles(pki["cert"], pki["key"], pki["ca"])
    want = (ACTIVATION.tos, ACTIVATION.priority)
    assert await _both_ends(TlsTransport(files, ACTIVATION)) == (want, want)
    assert await _both_ends(TlsTransport(files)) == ((0, 0), (0, 0))


def test_bad_activation_dscp_names_the_flag(tmp_path: Path) -> None:
    for bad in (-1, 64):
        with pytest.raises(ConfigError, match="--activation-dscp"):
            _config(tmp_path, activation_dscp=bad)
    with pytest.raises(ValueError, match="dscp"):
        TrafficClass(dscp=64, priority=0)
    with pytest.raises(ValueError, match="priority"):
        TrafficClass(dscp=AF41, priority=7)


def test_plain_transport_marks_nothing_by_default() -> None:
    assert TcpTransport().mark is None
    assert ACTIVATION.tos == 0x88  # AF41, what docs/dataplane.md tells a fabric to prioritise


# -- the emulated links (bench/netlab.py, the `netlab` fixture in conftest.py) ------------------------

SEND = """
import socket, sys
tos, dst, n = int(sys.argv[1], 0), sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
for _ in range(n):
    s.sendto(b"q" * 1000, (dst, 9))
"""


@pytest.mark.netns
def test_netlab_links_send_the_activation_class_through_its_own_htb_class(netlab: ModuleType) -> None:
    lab = netlab.NetLab(2, rate_mbit=50, prefix=f"kq{secrets.token_hex(2)}", qos=True)
    act, bulk, n = netlab.ACTIVATION_CLASS, netlab.BULK_CLASS, 40
    with lab:

        def sent() -> tuple[dict[int, int], dict[int, int]]:
            return lab.class_bytes(0, "up"), lab.class_bytes(1, "down")

        def send(tos: int) -> tuple[dict[int, int], dict[int, int]]:
            before = sent()
            subprocess.run([*lab.prefix(0), sys.executable, "-c", SEND, hex(tos), lab.addr(1), str(n)], check=True)
            after = sent()
            return tuple({c: after[k][c] - before[k].get(c, 0) for c in (act, bulk)} for k in range(2))  # type: ignore[return-value]

        send(0)  # ARP resolved first: its frames (not IP) go to bulk, and would blur the counts below
        payload = n * 1000
        for tos, cls in ((ACTIVATION.tos, act), (ACTIVATION.tos | 0x01, act), (0, bulk), (0x20, bulk)):
            for side, delta in zip(("up", "down"), send(tos), strict=True):
                other = bulk if cls == act else act
                assert delta[cls] >= payload, f"tos {tos:#x} {side}: {delta} (want >= {payload} in 1:{cls})"
                assert delta[other] < payload // 4, f"tos {tos:#x} {side}: {delta} (1:{other} should be idle)"


@pytest.mark.netns
def test_two_group_netlab_links_send_the_activation_class_first_under_each_peer_leaf(netlab: ModuleType) -> None:
    """Two leaves and a spine (groups=2): with QoS, the per-peer leaf of host 0's uplink (and of the switch
    port to the receiver) queues the marked packets in its activation class, in-group and cross-group alike."""
    lab = netlab.NetLab(4, rate_mbit=50, groups=2, spine_ratio=0.5, prefix=f"kq{secrets.token_hex(2)}", qos=True)
    act, bulk, n = netlab.ACTIVATION_CLASS, netlab.BULK_CLASS, 40
    with lab:
        for peer in (1, 2):  # host 1: same leaf; host 2: across the spine
            leaf_up, leaf_down = f"{100 + peer}", f"{100 + 0}"  # the sender's leaf for the peer; the port's for host 0

            def sent(peer: int = peer) -> tuple[dict[str, int], dict[str, int]]:
                return lab.class_bytes_by_id(0, "up"), lab.class_bytes_by_id(peer, "down")

            def send(
                tos: int, peer: int = peer, leaves: tuple[str, str] = (leaf_up, leaf_down)
            ) -> list[dict[int, int]]:
                before = sent()
                subprocess.run(
                    [*lab.prefix(0), sys.executable, "-c", SEND, hex(tos), lab.addr(peer), str(n)], check=True
                )
                after = sent()
                return [
                    {c: after[k].get(f"{leaf}:{c}", 0) - before[k].get(f"{leaf}:{c}", 0) for c in (act, bulk)}
                    for k, leaf in enumerate(leaves)
                ]

            send(0)  # ARP first
            payload = n * 1000
            for tos, cls in ((ACTIVATION.tos, act), (0, bulk)):
                for side, delta in zip(("up", "down"), send(tos), strict=True):
                    other = bulk if cls == act else act
                    assert delta[cls] >= payload, (
                        f"peer {peer} tos {tos:#x} {side}: {delta} (want >= {payload} in :{cls})"
                    )
                    assert delta[other] < payload // 4, f"peer {peer} tos {tos:#x} {side}: {delta}"
