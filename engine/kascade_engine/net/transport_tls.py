"""TLS for the TCP transport: mutual authentication and encryption of every data-plane connection.

Data flow: `TlsFiles` (certificate, key, CA: three PEM paths, typically one Secret mounted in every
engine pod) -> `TlsFiles.contexts()` (server and client `ssl.SSLContext`, TLS 1.2+, both ends must present
a certificate signed by the CA) -> `TlsTransport.listen/connect` -> `TlsConnection`, the same framed
`Connection` as plain TCP (`transport.py`), over asyncio streams.

What it protects: weights, activations, KV and plan tokens are encrypted on the wire, and a peer
without a certificate from the installation's CA is refused during the TLS handshake, before it can
send a single frame (so before the plan-token hello, which still authenticates the peer as a member of
this plan). Peers are addressed by pod IP, so names are not checked: the CA is the trust boundary (a
certificate for one engine is a certificate for every engine of the installation).
Cost: one extra copy per received payload (decrypted bytes are copied into the block buffer) and the
cipher itself; the plain TCP transport stays the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

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

# As on plain TCP: admission.py's caps, with the TLS handshake counted as pending (MAX_PENDING)
HANDSHAKE_TIMEOUT_S = 10.0
STREAM_LIMIT = 4 * 1024 * 1024  # asyncio reader buffer; frames are read with readexactly
log = logging.getLogger(__name__)


class TlsError(ValueError):
    """A TLS setting that cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path

    @staticmethod
    def from_flags(cert: Path | None, key: Path | None, ca: Path | None) -> TlsFiles | None:
        """None when no flag is given; all three or an error naming what is missing."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, v in given.items() if v is None]
        if missing:
            raise TlsError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
        assert cert is not None and key is not None and ca is not None
        return TlsFiles(Path(cert), Path(key), Path(ca))

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server, client) contexts; every problem with a file is a `TlsError` naming its flag."""
        return self._context(ssl.Purpose.CLIENT_AUTH), self._context(ssl.Purpose.SERVER_AUTH)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # peers are pod IPs; the CA is the trust boundary (module docstring)
        ctx.verify_mode = ssl.CERT_REQUIRED  # both directions: mutual TLS
        try:
            ctx.load_verify_locations(cafile=str(self.ca))
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"--tls-ca {self.ca}: {_why(e)}") from None
        try:
            ctx.load_cert_chain(certfile=str(self.cert), keyfile=str(self.key))
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"--tls-cert {self.cert} / --tls-key {self.key}: {_why(e)}") from None
        return ctx


def _why(e: Exception) -> str:
    if isinstance(e, FileNotFoundError):
        return "no such file"
    return str(getattr(e, "reason", None) or getattr(e, "strerror", None) or e)


class TlsConnection(Admissible):
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, traffic: Traffic | None = None
    ) -> None:
        super().__init__()
        self.reader, self.writer = reader, writer
        self.traffic = traffic if traffic is not None else Traffic()
        addr = writer.get_extra_info("peername")
        self.peer = f"{addr[0]}:{addr[1]}" if addr else "?"
        own = writer.get_extra_info("sockname")
        self.local: str | None = f"{own[0]}:{own[1]}" if own else None

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"",
                   timeout: float | None = None) -> None:
        prefix, raw = encode_prefix(header, len(payload))
        try:
            async with asyncio.timeout(timeout):
                self.writer.write(prefix + raw)
                if len(payload):
                    self.writer.write(payload)
                await self.writer.drain()
            self.traffic.sent += len(payload)
        except TimeoutError:
            raise TransportError(f"{self.peer} took nothing for {timeout} s") from None
        except (ConnectionError, OSError, ssl.SSLError) as e:
            raise TransportError(f"tls send to {self.peer}: {e}") from None

    async def _exactly(self, n: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise TransportError(f"connection from {self.peer} closed") from None

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        try:
            async with asyncio.timeout(timeout):
                hlen, plen = decode_prefix(await self._exactly(PREFIX.size))
                raw = await self._exactly(hlen)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except (ConnectionError, OSError, ssl.SSLError) as e:
            raise TransportError(f"tls recv from {self.peer}: {e}") from None
        return decode_header(raw), plen

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                got = 0
                while got < len(view):  # bounded pieces: never buffer a whole large payload twice
                    piece = await self._exactly(min(len(view) - got, STREAM_LIMIT))
                    view[got:got + len(piece)] = piece
                    got += len(piece)
            self.traffic.received += len(view)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except (ConnectionError, OSError, ssl.SSLError) as e:
            raise TransportError(f"tls recv from {self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytearray]:
        return await read_frame(self, timeout, max_payload)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


class TlsListener:
    def __init__(self, server: asyncio.Server) -> None:
        self.server = server
        self.port = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2.0)


class TlsTransport:
    """The TCP transport with mutual TLS (see the module docstring)."""

    name = "tcp+tls"
    hash_on_landing = True  # decrypted by the loop thread, into place

    def __init__(self, files: TlsFiles, mark: TrafficClass | None = None) -> None:
        self.files = files
        self.traffic = Traffic()
        self.mark = mark  # every socket it connects or accepts carries this DSCP class (None: unmarked)
        self.server_ctx, self.client_ctx = files.contexts()  # bad files fail here, at startup, by name

    async def listen(self, host: str, port: int, handler: Handler) -> TlsListener:
        admitted: set[asyncio.Task[None]] = set()
        pending: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # insertion-ordered: the oldest first
        refusals = RefusalLog(f"tls listener {host}:{port}")

        def admit(task: asyncio.Task[None]) -> None:
            if pending.pop(task, None) is not None:  # (an evicted stranger's late proof admits nothing)
                admitted.add(task)

        async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Pending from accept, before the TLS handshake, until peerauth admits the connection: a flood of
            # peers that never finish holds at most MAX_PENDING sockets, and each newcomer evicts the oldest.
            addr = writer.get_extra_info("peername")
            peer = f"{addr[0]}:{addr[1]}" if addr else "?"
            task = asyncio.current_task()
            if task is None or len(admitted) >= MAX_CONNECTIONS:
                refusals.note(f"{len(admitted)} authenticated connections open; refusing {peer}")
                writer.transport.abort()
                return
            if len(pending) >= MAX_PENDING:
                oldest = next(iter(pending))
                refusals.note(f"{MAX_PENDING} connections in their handshake; evicting "
                              f"{pending.pop(oldest).get_extra_info('peername')}")
                # cancelled, not aborted under it: an aborted TLS handshake "succeeds" with no transport
                oldest.cancel()
            pending[task] = writer
            try:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):  # reset already: the handshake fails below
                        mark_socket(sock, self.mark)
                try:
                    await writer.start_tls(self.server_ctx, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
                except (ssl.SSLError, OSError, TimeoutError, ConnectionError) as e:
                    refusals.note(f"handshake with {peer} failed: {getattr(e, 'reason', None) or type(e).__name__}")
                    writer.transport.abort()
                    return
                if writer.transport is None:  # closed during the handshake
                    return
                conn = TlsConnection(reader, writer, self.traffic)
                conn.on_admit(lambda: admit(task))
                await serve(handler, conn, "tls connection")
            except asyncio.CancelledError:  # evicted (or the listener closes): the socket goes now
                with contextlib.suppress(Exception):
                    writer.transport.abort()
                raise
            finally:
                pending.pop(task, None)
                admitted.discard(task)

        try:
            server = await asyncio.start_server(serve_one, host, port, limit=STREAM_LIMIT, reuse_address=True)
        except OSError as e:
            raise TransportError(f"tls listen on {host}:{port}: {e}") from None
        return TlsListener(server)

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> TlsConnection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        mark_socket(sock, self.mark)  # before connect: the TCP and TLS handshakes are in the class too
        try:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.get_running_loop().sock_connect(sock, (host, port))
                    reader, writer = await asyncio.open_connection(
                        sock=sock, ssl=self.client_ctx, server_hostname=host, limit=STREAM_LIMIT,
                        ssl_handshake_timeout=timeout)
            except BaseException:
                sock.close()  # the streams never took it over
                raise
        except TimeoutError:
            raise TransportError(f"tls connect to {host}:{port}: no handshake within {timeout} s") from None
        except ssl.SSLError as e:
            raise TransportError(f"tls connect to {host}:{port}: handshake refused: {e.reason or e}") from None
        except OSError as e:
            raise TransportError(f"tls connect to {host}:{port}: {e}") from None
        return TlsConnection(reader, writer, self.traffic)
