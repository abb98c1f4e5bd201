"""UCX transport through ucxx (the maintained successor of ucx-py).

Listener (sockaddr) endpoints: they carry peer-failure detection, work across hosts and network
namespaces, and pick the best UCX transport available (RDMA verbs on clusters built with it; TCP here).
A frame is three tag messages in order: the fixed prefix, the JSON header, the payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import numpy as np

from kascade_engine.transport import (
    PREFIX,
    Connection,
    Handler,
    Header,
    TransportError,
    decode_header,
    decode_prefix,
    encode_prefix,
    read_frame,
)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a variable UCX 1.21 no longer knows


def _ucxx() -> Any:
    import ucxx

    return ucxx


def _as_array(buf: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


class UcxConnection:
    def __init__(self, ep: Any, peer: str) -> None:
        self.ep, self.peer = ep, peer

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"") -> None:
        prefix, raw = encode_prefix(header, len(payload))
        try:
            await self.ep.send(_as_array(prefix))
            await self.ep.send(_as_array(raw))
            if len(payload):
                await self.ep.send(_as_array(payload))
        except Exception as e:  # ucxx raises its own exception types
            raise TransportError(f"ucx send to {self.peer}: {e}") from None

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        try:
            async with asyncio.timeout(timeout):
                prefix = np.empty(PREFIX.size, dtype=np.uint8)
                await self.ep.recv(prefix)
                hlen, plen = decode_prefix(prefix.tobytes())
                raw = np.empty(hlen, dtype=np.uint8)
                await self.ep.recv(raw)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"ucx recv from {self.peer}: {e}") from None
        return decode_header(raw.tobytes()), plen

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self.ep.recv(np.frombuffer(view, dtype=np.uint8))
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except Exception as e:
            raise TransportError(f"ucx recv from {self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None) -> tuple[Header, bytearray]:
        return await read_frame(self, timeout)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ep.close()


class UcxListener:
    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self.port = int(listener.port)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.listener.close()


class UcxTransport:
    name = "ucx"

    async def listen(self, host: str, port: int, handler: Handler) -> UcxListener:
        ucxx = _ucxx()

        async def on_ep(ep: Any) -> None:
            conn = UcxConnection(ep, "ucx-peer")
            try:
                await handler(conn)
            finally:
                await conn.close()

        try:
            return UcxListener(ucxx.create_listener(on_ep, port or None))
        except Exception as e:
            raise TransportError(f"ucx listen on port {port}: {e}") from None

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        ucxx = _ucxx()
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), timeout)
        except Exception as e:
            raise TransportError(f"ucx connect to {host}:{port}: {e}") from None
        return UcxConnection(ep, f"{host}:{port}")
