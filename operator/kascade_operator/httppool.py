"""HTTP clients per engine endpoint: one small keep-alive pool each.

Why not one shared `httpx.AsyncClient`: its connection pool scans every pooled connection on every
request, so with hundreds of engines kept alive each scrape costs O(engines) (measured: most of the
operator's CPU at 20 services x 2 engines, 10 rounds/s). One client per endpoint keeps each request
O(1), and a client unused for a while is closed.

Data flow: Scraper / EngineClient -> `HttpPool.get(endpoint)` -> a cached client (created on first
use, timeout applied) -> the request; `prune(keep)` closes clients of endpoints that are gone.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx


class HttpPool:
    def __init__(self, timeout_s: float, shared: httpx.AsyncClient | None = None) -> None:
        """`shared`: use this one client for every endpoint (tests inject a mock transport this way)."""
        self._timeout = httpx.Timeout(timeout_s)
        self._shared = shared
        self._clients: dict[str, httpx.AsyncClient] = {}

    def get(self, endpoint: str) -> httpx.AsyncClient:
        if self._shared is not None:
            return self._shared
        c = self._clients.get(endpoint)
        if c is None:
            c = self._clients[endpoint] = httpx.AsyncClient(
                timeout=self._timeout, limits=httpx.Limits(max_connections=8, max_keepalive_connections=2))
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
