"""The transport interface: framed messages (a JSON header plus a raw payload) between two peers.

Data flow: `Transport.listen(host, port, handler)` / `Transport.connect(host, port)` -> `Connection`
-> `send(header, payload)` / `recv() -> (header, payload)`. Framing is explicit and length-prefixed
(never pickle): b"KSC1" | u32 header length | u64 payload length | JSON header | payload.
Implementations: asyncio TCP (`transport_tcp`), TCP with mutual TLS (`transport_tls`) and UCX through
ucxx (`transport_ucx`); `transports.make_transport(name)` picks one by its setting name (`TRANSPORTS`). Each counts
the payload bytes its connections moved (`Traffic`), where the bytes meet the wire, so a test or a metric
sees which transport carried them.

Traffic classes: a TCP transport made with a `TrafficClass` marks every socket it opens or accepts
(IP TOS = DSCP << 2, and SO_PRIORITY) so a QoS-configured fabric can send those packets ahead of bulk
traffic on a shared link. The engine marks its act-port transport (activations, pair steps, PD KV:
latency-critical, small) with `ACTIVATION` (DSCP AF41) and leaves the weight transport unmarked
(`None`: best effort, DSCP 0), so a weight stream never delays a step's activations in the fabric's queues.
Its HTTP listener (`serving_socket`: the tokens it streams to clients, the control API's answers) carries
the same class: a source streams its clients' tokens up the link it sends a target's weights on.
UCX (RDMA) has no IP TOS of its own: there the fabric's traffic class is configured in UCX/the NIC.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

MAGIC = b"KSC1"
PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024
TRANSPORTS = ("tcp", "ucx")  # the names an engine's --transport (and make_transport) accepts


@dataclass(frozen=True)
class TrafficClass:
    """A DSCP class for a transport's sockets: `tos` is the IP TOS byte (DSCP << 2; the two ECN bits stay
    the kernel's), `priority` the socket's SO_PRIORITY (the host's own qdiscs and a VLAN egress map to
    802.1p PCP, which a lossless RoCE/PFC fabric classifies by)."""

    dscp: int
    priority: int

    def __post_init__(self) -> None:
        if not 0 <= self.dscp <= 63:
            raise ValueError(f"dscp must be in [0, 63], got {self.dscp}")
        if not 0 <= self.priority <= 6:  # 7 needs CAP_NET_ADMIN
            raise ValueError(f"priority must be in [0, 6], got {self.priority}")

    @property
    def tos(self) -> int:
        return self.dscp << 2


AF41 = 34  # DSCP "assured forwarding 4, low drop" (RFC 2597): interactive, latency-sensitive data
# The engine's activation connections (pair steps, pipeline hops, PD KV): TOS 0x88, SO_PRIORITY 4.
ACTIVATION = TrafficClass(dscp=AF41, priority=4)


def activation_class(dscp: int) -> TrafficClass | None:
    """The class the act-port transport marks with for an engine's `--activation-dscp` (0: no mark)."""
    return None if dscp == 0 else TrafficClass(dscp=dscp, priority=ACTIVATION.priority)


def mark_socket(sock: socket.socket, mark: TrafficClass | None) -> None:
    """Set `mark`'s TOS and SO_PRIORITY on an IPv4/IPv6 TCP socket (before connect, so the handshake
    carries it too; accepted sockets are marked at accept). None leaves the socket best effort."""
    if mark is None:
        return
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, mark.tos)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, mark.tos)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, mark.priority)


class TransportError(Exception):
    """Any failure of a connection: closed, reset, timed out, or a malformed frame."""


Header = dict[str, Any]


@dataclass
class Traffic:
    """Payload bytes (not frame headers) a transport's connections sent and received, counted by the
    connection once the bytes were handed to / taken from the wire: shared by all connections of one
    `Transport` object."""

    sent: int = 0
    received: int = 0


def encode_prefix(header: Header, payload_len: int) -> tuple[bytes, bytes]:
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER:
        raise TransportError(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    if payload_len > MAX_PAYLOAD:
        raise TransportError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(MAGIC, len(raw), payload_len), raw


def decode_prefix(prefix: bytes) -> tuple[int, int]:
    magic, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise TransportError(f"bad frame magic {magic!r}")
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise TransportError(f"frame too large (header {hlen}, payload {plen})")
    return hlen, plen


def decode_header(raw: bytes) -> Header:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TransportError(f"malformed header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise TransportError("malformed header: needs an object with a string 'op'")
    return header


class Connection(Protocol):
    peer: str  # "host:port" of the other end, as this socket sees it
    local: str | None  # "host:port" of this end (None where the transport cannot tell: UCX)

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"",
                   timeout: float | None = None) -> None:
        """Send one frame; a peer that takes none of it for `timeout` s is a TransportError (a dead
        peer behind an endpoint without failure detection, or a live one that stopped reading)."""
        ...

    async def recv(self, timeout: float | None = None, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytearray]:
        """A whole frame; one announcing more than `max_payload` bytes is refused before any is read
        (0 for frames that carry none, such as a hello: nothing is allocated before authentication)."""
        ...

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        """The next frame's header and its payload length; the payload must be read next."""
        ...

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        """Read exactly len(view) payload bytes into `view` (no intermediate copy)."""
        ...

    async def close(self) -> None: ...

    async def abort(self) -> None:
        """Close at once, discarding what is still buffered either way (the peer sees a reset)."""
        ...


class Listener(Protocol):
    port: int

    async def close(self) -> None: ...


Handler = Callable[[Connection], Awaitable[None]]
log = logging.getLogger(__name__)


async def serve(handler: Handler, conn: Connection, what: str) -> None:
    """One accepted connection's life on a listener (every transport): `handler` runs, its failure is
    logged naming `what` and the peer (it never ends the listener, and is not silent), and the
    connection is closed after."""
    try:
        await handler(conn)
    except Exception as e:
        log.warning("%s from %s failed: %s: %s", what, conn.peer, type(e).__name__, e)
    finally:
        await conn.close()


class Transport(Protocol):
    name: str
    traffic: Traffic
    # True when a received payload's bytes are copied into place by the receiving thread itself (a
    # socket read), so hashing them right after they land reads them from that core's cache. UCX lands
    # them from its progress thread: there the relay hashes a block once, at commit, off its loop.
    hash_on_landing: bool

    async def listen(self, host: str, port: int, handler: Handler) -> Listener: ...

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection: ...


async def read_frame(
    conn: Connection, timeout: float | None, max_payload: int = MAX_PAYLOAD
) -> tuple[Header, bytearray]:
    """A whole frame into a fresh buffer (for control messages; chunks go through `recv_into`)."""
    header, plen = await conn.recv_header(timeout)
    if plen > max_payload:
        raise TransportError(f"{header.get('op')!r} frame from {conn.peer} announces {plen} payload bytes; "
                             f"at most {max_payload} allowed here")
    payload = bytearray(plen)
    if plen:
        await conn.recv_into(memoryview(payload), timeout)
    return header, payload


async def close_handshake(conn: Connection, timeout: float, sent_end: bool) -> None:
    """Close a stream without losing its tail: UCX may drop messages still in flight when an endpoint
    closes, so the side that sent `end` waits for the reader's `bye` before closing, and the reader,
    after its `bye`, waits (briefly) for the sender to close first. Failures here change nothing: every
    block was already committed or will be re-fetched."""
    with contextlib.suppress(TransportError, TimeoutError):
        if sent_end:
            await conn.recv_header(timeout=timeout)  # the reader's bye (or its close)
        else:
            await conn.send({"op": "bye"}, timeout=timeout)
            await conn.recv_header(timeout=min(timeout, 2.0))  # returns once the sender has closed


def serving_socket(host: str, port: int, mark: TrafficClass | None, backlog: int = 2048) -> socket.socket:
    """The engine's HTTP listening socket (OpenAI API, control API, probes), bound and listening, for uvicorn.

    Marked with `mark` (the engine's latency class, `--activation-dscp`): Linux copies a listener's TOS to every
    connection it accepts (and its SYN-ACK), so every answer, above all the tokens the engine streams to its
    clients, leaves in that DSCP class (what a fabric classifies by; SO_PRIORITY is not inherited, and the
    accepted connections are uvicorn's). Why: a serving source streams its clients' tokens
    up the same link it sends a loading target's weights on; unmarked, they queued behind the weights (bench
    live, 7 Mbit/s links: ~0.3 s added to every first token a source streamed while its weight stream kept the
    link's queue full, the tail of ZigZag's TTFT; ADR 0007).
    IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it every
    keep-alive request waited ~40 ms on Nagle + delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mark_socket(sock, mark)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
