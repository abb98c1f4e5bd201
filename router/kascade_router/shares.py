"""Live replicas' weights, refreshed between requests.

A live (still loading) replica's router weight is the serving share its engine reports on its answers
(`backends.live_weight`). Refreshed only by its own answers, a small share sustains itself: the balancer
rarely picks the replica, so it rarely reports the share it has grown into, and it stays starved until it
is complete, then gets a burst (bench/live.py: a B at 1/8 with 3 requests in flight got none for 3-4 s).
`ShareRefresher` asks every live backend for its share every `interval_s` and applies it the same way.

The same poll carries the prefill rates of prefill engines and converted decoders (PREFILL_RATE_HEADER): a
router ranks a converted decoder by its rate over a prefill engine's (balancer), and in disaggregated serving
it never hears a prefill engine's answers (every request goes to a decoder, which pulls its KV).

Data flow: `Routes` (backends with `live`, role prefill, or convertible) -> GET /readyz on each (the engines'
TLS when set; the engine sends SERVING_SHARE_HEADER and PREFILL_RATE_HEADER there too) ->
`Backend.reported(share)` (live ones), `Backend.reported_rate(rate)`. A failed or refused poll changes
nothing: ejecting unreachable engines is the proxy's job, on real requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import aiohttp

from kascade_planner.engine_api import PREFILL_RATE_HEADER, SERVING_SHARE_HEADER
from kascade_router.backends import Backend, Routes

log = logging.getLogger(__name__)


class ShareRefresher:
    """One task polling the live backends of `routes` every `interval_s` (0: never, answers only)."""

    def __init__(self, routes: Routes, interval_s: float, tls: ssl.SSLContext | None = None,
                 timeout_s: float = 1.0) -> None:
        self.routes, self.interval_s, self.tls = routes, interval_s, tls
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.polls = 0  # answers applied (a metric for tests and logs)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
            self._task = asyncio.create_task(self._run(), name="live-shares")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def refresh(self) -> None:
        """Poll every live backend, prefill engine and converted decoder once, together."""
        polled = [b for bs in self.routes.backends.values() for b in bs.values()
                  if b.live or b.role == "prefill" or b.convertible]
        if polled:
            await asyncio.gather(*(self._one(b) for b in polled))

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def _one(self, b: Backend) -> None:
        assert self._session is not None
        scheme = "https" if self.tls is not None else "http"
        try:
            async with self._session.get(f"{scheme}://{b.address}/readyz", ssl=self.tls or False) as r:
                share, rate = r.headers.get(SERVING_SHARE_HEADER), r.headers.get(PREFILL_RATE_HEADER)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("share of %s (%s): %s", b.pod, b.address, e)
            return
        b.reported_rate(rate)
        if share is not None and b.live:  # it may have completed (or gone) while we asked
            b.reported(share)
        self.polls += 1
