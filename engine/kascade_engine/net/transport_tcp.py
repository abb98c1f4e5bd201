"""Plain asyncio TCP transport on raw non-blocking sockets (TCP_NODELAY, large buffers).

Payloads can be received straight into a caller's buffer (`recv_into`), so a relay writes each chunk
exactly once: from the socket into the block buffer. A listener admits connections under admission.py's caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct

from kascade_engine.net.admission import MAX_CONNECTIONS, MAX_PENDING, Admissible, RefusalLog
from kascade_engine.net.transport import (
    MAX_PAYLOAD,
    PREFIX,
    Handler,
    Header,
    Traffic,
    TrafficClass,
    TransportError,
    decode_header,
    decode_prefix,
    encode_prefix,
    mark_socket,
    read_frame,
    serve,
)

BUF = 4 * 1024 * 1024
log = logging.getLogger(__name__)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)


class TcpConnection(Admissible):
    def __init__(self, sock: socket.socket, traffic: Traffic | None = None) -> None:
        super().__init__()
        self.sock = sock
        self.traffic = traffic if traffic is not None else Traffic()
        _tune(sock)
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"
        try:
            host, port = sock.getsockname()[:2]
            self.local: str | None = f"{host}:{port}"
        except OSError:
            self.local = None
        self.loop = asyncio.get_running_loop()
        self._busy = 0  # socket operations (sends, reads) awaiting the event loop right now
        self.closed = False

    def _enter(self) -> None:
        self._busy += 1

    def _leave(self) -> None:
        self._busy -= 1
        if self.closed and not self._busy:
            self.sock.close()  # deferred by close(): the loop has dropped this fd's reader/writer by now

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"",
                   timeout: float | None = None) -> None:
        prefix, raw = encode_prefix(header, len(payload))
        self._enter()
        try:
            async with asyncio.timeout(timeout):
                await self.loop.sock_sendall(self.sock, prefix + raw)
                if len(payload):
                    await self.loop.sock_sendall(self.sock, payload)
            self.traffic.sent += len(payload)
        except TimeoutError:
            raise TransportError(f"{self.peer} took nothing for {timeout} s") from None
        except (ConnectionError, OSError) as e:
            raise TransportError(f"send to {self.peer}: {e}") from None
        finally:
            self._leave()

    async def _fill(self, view: memoryview) -> None:
        got = 0
        self._enter()
        try:
            while got < len(view):
                n = await self.loop.sock_recv_into(self.sock, view[got:])
                if n == 0:
                    raise TransportError(f"connection from {self.peer} closed")
                got += n
        finally:
            self._leave()

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        try:
            async with asyncio.timeout(timeout):
                prefix = bytearray(PREFIX.size)
                await self._fill(memoryview(prefix))
                hlen, plen = decode_prefix(bytes(prefix))
                raw = bytearray(hlen)
                await self._fill(memoryview(raw))
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except (ConnectionError, OSError) as e:
            raise TransportError(f"recv from {self.peer}: {e}") from None
        return decode_header(bytes(raw)), plen

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._fill(view)
            self.traffic.received += len(view)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except (ConnectionError, OSError) as e:
            raise TransportError(f"recv from {self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytearray]:
        return await read_frame(self, timeout, max_payload)

    async def close(self) -> None:
        """Close now, or, while a send or read is waiting in the event loop, shut the socket down (that
        wakes it with EOF / EPIPE) and close when it returns. Closing the fd under a waiting read would
        leave the loop's selector holding a registration epoll has already dropped: the next socket to
        reuse that fd number would never be woken (a re-formed pipeline hop hung on it for 120 s)."""
        self.closed = True
        with contextlib.suppress(OSError):
            if self._busy:
                self.sock.shutdown(socket.SHUT_RDWR)
            else:
                self.sock.close()

    async def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        await self.close()


class TcpListener:
    def __init__(self, sock: socket.socket, task: asyncio.Task[None]) -> None:
        self.sock, self.task = sock, task
        self.port = int(sock.getsockname()[1])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        self.sock.close()


class TcpTransport:
    name = "tcp"
    hash_on_landing = True

    def __init__(self, mark: TrafficClass | None = None) -> None:
        self.traffic = Traffic()
        self.mark = mark  # every socket it connects or accepts carries this DSCP class (None: unmarked)

    async def listen(self, host: str, port: int, handler: Handler) -> TcpListener:
        loop = asyncio.get_running_loop()
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mark_socket(lsock, self.mark)  # the SYN-ACK too (accepted sockets are marked again at accept)
        try:
            lsock.bind((host, port))
        except OSError as e:
            lsock.close()
            raise TransportError(f"listen on {host}:{port}: {e}") from None
        lsock.listen(128)
        lsock.setblocking(False)
        admitted: set[TcpConnection] = set()
        pending: dict[TcpConnection, None] = {}  # insertion-ordered: the oldest stranger first
        tasks: set[asyncio.Task[None]] = set()  # strong references: a bare task may be collected mid-run
        refusals = RefusalLog(f"listener {host}:{port}")

        async def serve_one(conn: TcpConnection) -> None:
            try:
                await serve(handler, conn, "connection")
            finally:
                pending.pop(conn, None)
                admitted.discard(conn)

        def admit(conn: TcpConnection) -> None:
            pending.pop(conn, None)
            if not conn.closed:  # (an evicted stranger's late proof admits nothing)
                admitted.add(conn)

        async def accept_loop() -> None:
            while True:
                sock, addr = await loop.sock_accept(lsock)
                if len(admitted) >= MAX_CONNECTIONS:
                    refusals.note(f"{len(admitted)} authenticated connections open; refusing {addr}")
                    sock.close()
                    continue
                if len(pending) >= MAX_PENDING:
                    oldest = next(iter(pending))
                    del pending[oldest]
                    refusals.note(f"{MAX_PENDING} connections in their handshake; evicting {oldest.peer}")
                    await oldest.abort()  # its handshake wakes with an error and its task ends
                with contextlib.suppress(OSError):  # a socket reset before we mark it fails on first use
                    mark_socket(sock, self.mark)  # our side of the stream (replies, ACKs) in the same class
                try:
                    conn = TcpConnection(sock, self.traffic)
                except OSError:
                    sock.close()
                    continue
                conn.on_admit(functools.partial(admit, conn))
                pending[conn] = None
                t = asyncio.create_task(serve_one(conn))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        return TcpListener(lsock, asyncio.create_task(accept_loop()))

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> TcpConnection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        mark_socket(sock, self.mark)  # before connect: the handshake is in the class too
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        except (OSError, TimeoutError) as e:
            sock.close()
            raise TransportError(f"connect to {host}:{port}: {e}") from None
        return TcpConnection(sock, self.traffic)
