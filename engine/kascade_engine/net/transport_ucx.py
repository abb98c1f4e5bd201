"""UCX transport through ucxx (the maintained successor of ucx-py).

Listener (sockaddr) endpoints carry every connection: they detect peer failure, work across hosts and
network namespaces, and pick the best UCX transport available (RDMA verbs on clusters built with it;
TCP here). A frame is three messages in order: the fixed prefix, the JSON header, the payload.

Same-host fast path: listener endpoints cannot use shared memory (they force error handling), so when
both ends share a kernel and a network namespace the connect handshake also exchanges UCX worker
addresses, and payloads of `FAST_MIN` bytes or more are sent over a worker-address endpoint (zero-copy
cma) under a tag the header names. One such endpoint per peer worker, shared by every connection to it
and kept for the transport's life: closing one while another connection's payload was in flight
cancelled that receive. The receive of a tagged payload is posted on the connection's own listener
endpoint (UCP matches tags per worker, whichever endpoint sent them), so a dead peer or a closed
connection cancels it as it does any other receive, and a send to a dead peer ends at the caller's
timeout (worker-address endpoints detect no failures). Opt-in (`KASCADE_UCX_FAST_PATH=1`, or
`UcxTransport(fast_path=True)`): with error handling off, UCX treats a sender that dies while the
receiver reads its memory (cma) as fatal and aborts the receiving process (seen here when the middle
of a chain was killed), which would turn one lost peer into two. Loopback here: listener endpoints
~1.0-1.5 GB/s, fast path ~1.7-2.1 GB/s.

Listening on one address: ucxx's Python listener always binds every interface (its C++ builder can
take a host; the binding does not pass one), so when the spec names an address the listener closes any
endpoint that reached it on another local address (asked of UCP with `ucp_ep_query`) before a byte of
the handshake is exchanged. If UCP cannot say, the endpoint is closed too: fail closed.

Waiting on a request without spinning, and keeping one abandoned in flight alive: `ucxrequest`.

Addresses for peer authentication: an accepted connection's `local` is the address the client reached
(UCP's local sockaddr of the endpoint, with the listener's port), and a connecting one's `peer` is the
IP it dialled (a host name is resolved first, and UCX is given that IP), so peerauth's relay check (the
client's proof names the address it dialled; the server refuses one made for another) holds over UCX as
it does over TCP. That matters because a decode engine dials the prefill address a request names.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import ipaddress
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from kascade_engine.net.transport import (
    MAX_PAYLOAD,
    PREFIX,
    Connection,
    Handler,
    Header,
    Traffic,
    TransportError,
    decode_header,
    decode_prefix,
    encode_prefix,
    read_frame,
    serve,
)
from kascade_engine.net.ucxrequest import recv, release_settled, send


def _ucxx() -> Any:
    """ucxx, imported on first use with this transport's UCX defaults (a user's own settings win)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a variable UCX 1.21 no longer knows
    # TCP (the only inter-host transport without RDMA): 1 MiB segments instead of 8 KiB/64 KiB roughly
    # doubled a stream here (~0.6 -> ~1.3 GB/s on loopback) at the cost of larger receive descriptors.
    os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "1m")
    os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "1m")
    import ucxx

    return ucxx


FAST_MIN = 64 * 1024
CLOSE_TIMEOUT_S = 2.0
CONNECT_POLL_S = 0.02  # how often a connecting endpoint is checked for a UCP error
WILDCARD = ("", "0.0.0.0", "::")
WARM_UP_S = 30.0  # the bound of the first-connection warm-up (it took up to 5.4 s at load 28)
log = logging.getLogger(__name__)


class _EpAttr(ctypes.Structure):
    """ucp_ep_attr_t up to the fields queried (sockaddrs are sockaddr_storage, 128 bytes), plus room."""
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local", ctypes.c_ubyte * 128), ("remote", ctypes.c_ubyte * 128), ("_rest", ctypes.c_ubyte * 128)]


@functools.cache
def _ucp_ep_query() -> Any:
    lib = ctypes.CDLL("libucp.so.0")  # already loaded by ucxx: this finds the same copy
    lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
    lib.ucp_ep_query.restype = ctypes.c_int
    return lib.ucp_ep_query


def _sockaddr_ip(raw: bytes) -> str | None:
    family = int.from_bytes(raw[:2], "little")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None


def local_address(ep: Any) -> str | None:
    """The local IP address a UCX endpoint uses (None when UCP cannot tell)."""
    try:
        attr = _EpAttr(field_mask=1 << 1)  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
        if _ucp_ep_query()(int(ep.ucp_endpoint), ctypes.byref(attr)) != 0:
            return None
        return _sockaddr_ip(bytes(attr.local))
    except (OSError, AttributeError, TypeError, ValueError):
        return None


def _as_array(buf: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _locality() -> bytes:
    """Identifies this kernel boot and network namespace: equal on both ends means same host, same netns."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        return b""
    return f"{boot}|{netns}".encode()


async def _send_blob(ep: Any, blob: bytes) -> None:
    await send(ep, np.array([len(blob)], dtype=np.uint64))
    if blob:
        await send(ep, _as_array(blob))


async def _recv_blob(ep: Any, limit: int = 1 << 16) -> bytes:
    size = np.empty(1, dtype=np.uint64)
    await recv(ep, size)
    n = int(size[0])
    if n > limit:
        raise TransportError(f"ucx handshake blob of {n} bytes exceeds {limit}")
    buf = np.empty(n, dtype=np.uint8)
    if n:
        await recv(ep, buf)
    return buf.tobytes()


class UcxConnection:
    def __init__(self, ep: Any, peer: str, fast_ep: Any = None, traffic: Traffic | None = None) -> None:
        self.ep, self.peer, self.fast_ep = ep, peer, fast_ep
        self.traffic = traffic if traffic is not None else Traffic()
        self.local: str | None = None  # set by the listener for accepted connections (UCP says where they arrived)
        self._tag_base = secrets.randbits(40) << 24  # tags this end sends under
        self._seq = 0
        self._pending_tag: int | None = None

    async def send(self, header: Header, payload: bytes | bytearray | memoryview = b"",
                   timeout: float | None = None) -> None:
        fast = self.fast_ep is not None and len(payload) >= FAST_MIN
        if fast:
            self._seq += 1
            header = {**header, "_fastTag": self._tag_base | (self._seq & 0xFFFFFF)}
        prefix, raw = encode_prefix(header, len(payload))
        try:
            # The worker-address endpoint has no peer-failure detection: a send to a dead peer would
            # wait forever, so the timeout is what notices it.
            async with asyncio.timeout(timeout):
                await send(self.ep, _as_array(prefix))
                await send(self.ep, _as_array(raw))
                if fast:
                    await send(self.fast_ep, _as_array(payload), tag=header["_fastTag"])
                elif len(payload):
                    await send(self.ep, _as_array(payload))
            self.traffic.sent += len(payload)
        except TimeoutError:
            raise TransportError(f"{self.peer} took nothing for {timeout} s") from None
        except Exception as e:  # ucxx raises its own exception types
            raise TransportError(f"ucx send to {self.peer}: {e}") from None

    async def recv_header(self, timeout: float | None = None) -> tuple[Header, int]:
        try:
            async with asyncio.timeout(timeout):
                prefix = np.empty(PREFIX.size, dtype=np.uint8)
                await recv(self.ep, prefix)
                hlen, plen = decode_prefix(prefix.tobytes())
                raw = np.empty(hlen, dtype=np.uint8)
                await recv(self.ep, raw)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"ucx recv from {self.peer}: {e}") from None
        header = decode_header(raw.tobytes())
        tag = header.pop("_fastTag", None)
        if tag is not None and (self.fast_ep is None or not isinstance(tag, int)):
            raise TransportError(f"{self.peer} named a fast-path tag on a connection without one")
        self._pending_tag = tag
        return header, plen

    async def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        tag, self._pending_tag = self._pending_tag, None
        try:
            async with asyncio.timeout(timeout):
                if tag is not None:  # sent over the peer's worker-address endpoint; posted on ours
                    await recv(self.ep, np.frombuffer(view, dtype=np.uint8), tag=tag)
                else:
                    await recv(self.ep, np.frombuffer(view, dtype=np.uint8))
            self.traffic.received += len(view)
        except TimeoutError:
            raise TransportError(f"no data from {self.peer} for {timeout} s") from None
        except Exception as e:
            raise TransportError(f"ucx recv from {self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytearray]:
        return await read_frame(self, timeout, max_payload)

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # ucxx's close can wait forever on an endpoint in error
            await asyncio.wait_for(self.ep.close(), CLOSE_TIMEOUT_S)
        release_settled()  # what the close cancelled (the rest goes at a later close or park)
        self.fast_ep = None  # shared with other connections to the same worker: the transport keeps it

    async def abort(self) -> None:
        # Not ucxx's Endpoint.abort(): it blocks the event loop (close_blocking, up to 2 x 10 s) and can
        # deadlock with the progress thread over the GIL. A bounded close resets the peer as well.
        await self.close()


class UcxListener:
    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self.port = int(listener.port)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.listener.close()


class UcxTransport:
    name = "ucx"
    hash_on_landing = False  # written by the progress thread (see Transport)

    def __init__(self, fast_path: bool | None = None) -> None:
        self.fast_path = os.environ.get("KASCADE_UCX_FAST_PATH") == "1" if fast_path is None else fast_path
        self._fast_eps: dict[bytes, Any] = {}  # peer worker address -> its worker-address endpoint
        self.traffic = Traffic()
        self._warm = False

    async def _handshake(self, ep: Any) -> Any:
        """Both ends send (locality, worker address); returns the worker-address endpoint to the peer
        when both want the fast path and share a host and network namespace, else None."""
        ucxx = _ucxx()
        mine = _locality() if self.fast_path else b""
        await _send_blob(ep, mine)
        await _send_blob(ep, bytes(ucxx.get_worker_address()) if mine else b"")
        theirs = await _recv_blob(ep)
        address = await _recv_blob(ep)
        if not mine or theirs != mine or not address:
            return None
        if address not in self._fast_eps:
            peer = ucxx.get_ucx_address_from_buffer(address)
            fast = await ucxx.create_endpoint_from_worker_address(peer, endpoint_error_handling=False)
            self._fast_eps.setdefault(address, fast)  # a concurrent handshake may have made one first
        return self._fast_eps[address]

    async def listen(self, host: str, port: int, handler: Handler) -> UcxListener:
        ucxx = _ucxx()
        try:
            only = None if host in WILDCARD else {a[4][0] for a in socket.getaddrinfo(host, None)}
        except OSError as e:
            raise TransportError(f"ucx listen on {host}:{port}: {e}") from None

        bound: list[int] = []  # the listener's port, known once it listens (port 0 picks one)

        async def on_ep(ep: Any) -> None:
            addr = local_address(ep)
            if only is not None and addr not in only:
                log.warning("ucx listener on %s:%s: refused a connection that reached %s", host, port, addr)
                with contextlib.suppress(Exception):
                    await ep.close()
                return
            try:
                fast = await asyncio.wait_for(self._handshake(ep), 10)
            except Exception:
                with contextlib.suppress(Exception):
                    await ep.close()
                return
            conn = UcxConnection(ep, "ucx-peer", fast, self.traffic)
            if addr is not None and bound:  # what the client dialled, for peerauth's relay check
                conn.local = f"[{addr}]:{bound[0]}" if ":" in addr else f"{addr}:{bound[0]}"
            await serve(handler, conn, "ucx connection")

        try:
            listener = UcxListener(ucxx.create_listener(on_ep, port or None))
        except Exception as e:
            raise TransportError(f"ucx listen on port {port}: {e}") from None
        bound.append(listener.port)
        await self._warm_up()
        return listener

    async def _warm_up(self) -> None:
        """Pay UCX's first-connection cost now, not in a plan: a process's first endpoint (its first wireup
        of UCP's transports) took 0.8-5.4 s at load 11-28 here, later ones 10-80 ms, so a source's first push
        came 2-3.5 s after the plan began over UCX (10 ms over TCP) and a target's never-connected watchdog
        could fire first. One loopback connection to a private listener, once per transport; a failure only
        leaves the cost where it was."""
        if self._warm:
            return
        self._warm = True

        async def drop(ep: Any) -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._handshake(ep), WARM_UP_S)
            with contextlib.suppress(Exception):
                await ep.close()

        t0 = time.monotonic()
        private: UcxListener | None = None
        try:
            private = UcxListener(_ucxx().create_listener(drop))
            conn = await self.connect("127.0.0.1", private.port, timeout=WARM_UP_S)
            await conn.abort()
            log.debug("ucx warm-up: first connection in %.3f s", time.monotonic() - t0)
        except Exception as e:  # an optimisation: never fails the listener
            log.info("ucx warm-up failed after %.1f s (the first plan pays the cost): %s", time.monotonic() - t0, e)
        finally:
            if private is not None:
                await private.close()

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> Connection:
        try:
            host = await _ip_of(host)  # UCX dials the IP the connection's `peer` names (peerauth's claims)
            ep = await _create_endpoint(host, port, timeout)
            fast = await asyncio.wait_for(self._handshake(ep), timeout)
        except TimeoutError:
            raise TransportError(f"ucx connect to {host}:{port}: no answer within {timeout} s") from None
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"ucx connect to {host}:{port}: {type(e).__name__}: {e}") from None
        return UcxConnection(ep, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", fast, self.traffic)


async def _ip_of(host: str) -> str:
    """`host` itself when it is an IP address, else its first address (resolved off the event loop)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]")
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise TransportError(f"ucx connect to {host}: {e}") from None
    return str(infos[0][4][0])


async def _create_endpoint(host: str, port: int, timeout: float) -> Any:
    """A listener endpoint to host:port that fails as soon as UCP says the connection failed.

    `ucxx.create_endpoint` does not: after UCP reports a refused connection it still waits for the
    peer-info exchange (its `connect_timeout`, 5 s by default) before raising. A node that connects to a
    downstream whose listener is not up yet (peers start concurrently) then burned its whole retry budget
    on one attempt, dropped the downstream, and the downstream's watchdog re-fetched everything from a
    fallback: a clean 1->1 UCX transfer ended with `refetches == 1` whenever the target started listening
    after the source's first connect. Here the peer-info exchange (ucxx's own function) runs while the
    endpoint's error state is polled, so a refused connect fails in milliseconds and the caller retries.
    Built on ucxx internals; if they move, this falls back to the public call with our timeout."""
    ucxx = _ucxx()
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib_async.endpoint import Endpoint
        from ucxx._lib_async.exchange_peer_info import exchange_peer_info
        from ucxx._lib_async.utils import hash64bits
        from ucxx.core import _get_ctx
    except ImportError:  # pragma: no cover - only with a different ucxx layout
        return await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
    ctx = _get_ctx()
    ctx.continuous_ucx_progress()
    ucx_ep = ucx_api.UCXEndpoint.create(ctx.worker, host, port, True)
    msg_tag = hash64bits("msg_tag", os.urandom(16), ucx_ep.handle)
    exchange = asyncio.ensure_future(exchange_peer_info(endpoint=ucx_ep, msg_tag=msg_tag, listener=False,
                                                        connect_timeout=timeout))
    try:
        async with asyncio.timeout(timeout):
            while not exchange.done():
                ucx_ep.raise_on_error()  # e.g. "Endpoint is not connected": nobody listens there (yet)
                await asyncio.wait([exchange], timeout=CONNECT_POLL_S)
        info = exchange.result()
    except BaseException as e:
        exchange.cancel()
        with contextlib.suppress(BaseException):
            await exchange
        # The failed UCP endpoint is released with its last reference, as ucxx's own create_endpoint does.
        if isinstance(e, Exception) and not isinstance(e, TimeoutError):
            raise TransportError(f"ucx connect to {host}:{port}: {type(e).__name__}: {e}") from None
        raise
    return Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": info["msg_tag"], "msg_recv": msg_tag})
