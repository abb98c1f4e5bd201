"""Plain asyncio TCP transport (TCP_NODELAY, large socket buffers)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from kascade_engine.transport import (
    PREFIX,
    Connection,
    Handler,
    Header,
    TransportError,
    decode_header,
    decode_prefix,
    encode_prefix,
)

BUF = 4 * 1024 * 1024


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)


class TcpConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        _tune(writer)

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"") -> None:
        prefix, raw = encode_prefix(header, len(payload))
        try:
            self.writer.write(prefix + raw)
            if len(payload):
                self.writer.write(payload)
            await self.writer.drain()
        except (ConnectionError, OSError, RuntimeError) as e:
            raise TransportError(f"send to {self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None) -> tuple[Header, bytearray]:
        try:
            async with asyncio.timeout(timeout):
                prefix = await self.reader.readexactly(PREFIX.size)
                hlen, plen = decode_prefix(prefix)
                header = decode_header(await self.reader.readexactly(hlen))
                payload = bytearray(await self.reader.readexactly(plen)) if plen else bytearray()
        except asyncio.IncompleteReadError:
            raise TransportError(f"connection from {self.peer} closed") from None
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except (ConnectionError, OSError) as e:
            raise TransportError(f"recv from {self.peer}: {e}") from None
        return header, payload

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class TcpListener:
    def __init__(self, server: asyncio.Server) -> None:
        self.server = server
        self.port = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)


class TcpTransport:
    name = "tcp"

    async def listen(self, host: str, port: int, handler: Handler) -> TcpListener:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = TcpConnection(reader, writer)
            try:
                await handler(conn)
            finally:
                await conn.close()

        try:
            server = await asyncio.start_server(on_conn, host, port, limit=BUF, reuse_address=True)
        except OSError as e:
            raise TransportError(f"listen on {host}:{port}: {e}") from None
        return TcpListener(server)

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=BUF), timeout)
        except (OSError, TimeoutError) as e:
            raise TransportError(f"connect to {host}:{port}: {e}") from None
        return TcpConnection(reader, writer)
