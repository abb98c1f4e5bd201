"""A lean HTTP/1.1 GET for the metric sweep: one kept-alive connection per engine, no client library.

Why: the sweep scrapes every serving engine once per interval, so its cost per scrape is what grows with
the fleet. An httpx request costs about a millisecond of CPU (request/response models, header objects,
transport layers); at 200 engines and a 1 s interval that was most of the operator's CPU, and a shorter
interval (the reaction time from a crossing includes up to one interval) was out of reach. This writes
one request line and reads one response: status line, headers, a Content-Length (or chunked) body.

Data flow: Scraper -> `ScrapeConns.get(endpoint, path)` -> the endpoint's connection (opened on first use,
TLS with the installation's engine CA when given, reopened after any error) under a per-endpoint lock
(a sweep and a round may scrape the same engine at once) -> (status, body text). Errors raise
`ScrapeError` (the Scraper logs and leaves the instance out, as before); `aclose()` closes every
connection; `prune(keep)` those of engines that are gone.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable

MAX_BODY = 16 << 20  # an engine's /metrics is a few KiB; refuse anything absurd


class ScrapeError(Exception):
    pass


class _Conn:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class ScrapeConns:
    def __init__(self, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.timeout_s = timeout_s
        self._tls = tls
        self._conns: dict[str, _Conn] = {}

    async def get(self, endpoint: str, path: str) -> tuple[int, str]:
        """GET `path` from `endpoint` ("host:port"): (status, body). Raises ScrapeError (timeout included)."""
        c = self._conns.setdefault(endpoint, _Conn())
        async with c.lock:
            for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: reopen once
                fresh = c.writer is None
                try:
                    if c.writer is None:  # each phase has the timeout (as httpx: connect, then each read)
                        host, _, port = endpoint.rpartition(":")
                        async with asyncio.timeout(self.timeout_s):
                            c.reader, c.writer = await asyncio.open_connection(
                                host.strip("[]"), int(port), ssl=self._tls,
                                server_hostname=host.strip("[]") if self._tls is not None else None)
                    assert c.reader is not None
                    c.writer.write(f"GET {path} HTTP/1.1\r\nHost: {endpoint}\r\nAccept: */*\r\n\r\n".encode())
                    return await _response(c.reader, self.timeout_s)
                except _Closed as e:
                    c.close()
                    return e.status, e.text
                except asyncio.CancelledError:  # mid-request: the connection's next bytes would be this answer
                    c.close()
                    raise
                except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError, ScrapeError) as e:
                    c.close()
                    if fresh or attempt or isinstance(e, TimeoutError):
                        raise ScrapeError(f"GET {path}: {type(e).__name__}: {e}") from e
        raise ScrapeError(f"GET {path}: no response")  # pragma: no cover - the loop returns or raises

    async def prune(self, keep: Iterable[str]) -> None:
        keep_set = set(keep)
        for ep in [ep for ep in self._conns if ep not in keep_set]:
            self._conns.pop(ep).close()

    async def aclose(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()


async def _response(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, str]:
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ScrapeError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    status = int(parts[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    async with asyncio.timeout(timeout_s):
        data = await _body(reader, headers)
    if headers.get("connection", "").lower() == "close":
        raise _Closed(status, data.decode())
    return status, data.decode()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers expected: the final CRLF
                break
            if len(body) + size > MAX_BODY:
                raise ScrapeError("response too large")
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        return bytes(body)
    if "content-length" in headers:
        n = int(headers["content-length"])
        if n > MAX_BODY:
            raise ScrapeError("response too large")
        return await reader.readexactly(n)
    raise ScrapeError("response without a length (connection-delimited bodies are not kept alive)")


class _Closed(ScrapeError):
    """The server answered and closes the connection: the answer counts, the connection does not."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__("connection: close")
        self.status, self.text = status, text
