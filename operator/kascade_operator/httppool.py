"""HTTP clients per engine endpoint: one small keep-alive pool each.

Why not one shared `httpx.AsyncClient`: its connection pool scans every pooled connection on every
request, so with hundreds of engines kept alive each scrape costs O(engines) (measured: most of the
operator's CPU at 20 services x 2 engines, 10 rounds/s). One client per endpoint keeps each request
O(1), and a client unused for a while is closed.

Data flow: Scraper / EngineClient -> `HttpPool.url(endpoint, path)` (http, or https when the pool has the
installation's engine CA) and `HttpPool.get(endpoint)` -> a cached client (created on first use, timeout
and TLS verification applied) -> the request; `prune(keep)` closes clients of endpoints that are gone.

HTTPS to engines (`kascade_planner.engine_tls`, shared with the router): engines started with TLS files
serve their HTTP port with their data-plane certificate. Engines are addressed by pod IP, so the certificate is checked
against the
installation's CA only, not against a name (the trust model of the data plane, transport_tls.py).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable

import httpx


class HttpPool:
    def __init__(self, timeout_s: float, shared: httpx.AsyncClient | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`shared`: use this one client for every endpoint (tests inject a mock transport this way);
        `tls`: speak HTTPS verified by this context (`engine_tls_context`), else plain HTTP."""
        self._timeout = httpx.Timeout(timeout_s)
        self._shared = shared
        self._tls = tls
        self.scheme = "https" if tls is not None else "http"
        # one TLS context for every client: httpx builds a new one per client otherwise (verify=True loads the CA
        # bundle each time), 0.83 MB of the C heap per engine: the operator that bound 1,000 engines held ~0.8 GB
        # of them (bench/reaction.py --scale 10000,1000). Plain HTTP never uses it.
        self._verify: ssl.SSLContext = tls if tls is not None else ssl.create_default_context()
        self._clients: dict[str, httpx.AsyncClient] = {}

    def url(self, endpoint: str, path: str) -> str:
        """`path` (starting with /) on `endpoint` ("host:port") in this pool's scheme."""
        return f"{self.scheme}://{endpoint}{path}"

    def get(self, endpoint: str) -> httpx.AsyncClient:
        if self._shared is not None:
            return self._shared
        c = self._clients.get(endpoint)
        if c is None:
            c = self._clients[endpoint] = httpx.AsyncClient(
                timeout=self._timeout, limits=httpx.Limits(max_connections=8, max_keepalive_connections=2),
                verify=self._verify)
        return c

    async def prune(self, keep: Iterable[str]) -> None:
        keep_set = set(keep)
        for ep in [ep for ep in self._clients if ep not in keep_set]:
            await self._clients.pop(ep).aclose()

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
        if self._shared is not None:
            await self._shared.aclose()
