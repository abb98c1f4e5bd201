"""Backend health: outlier ejection by consecutive failures and by latency (a hung replica).

Why not eject on any failure: an engine at its connection cap closes new connections before answering, and a
single such close used to eject the backend for 5 s for every request (an innocent request waited 20 s). Why
not a plain read timeout: a replica that accepts TCP and answers nothing (stopped, wedged) held every request
sent to it for the 300 s read timeout. So:

- a refused connection (nothing listens: the process is gone) ejects the backend at once for `eject_s`;
- other failures before an answer (closed, reset) count; `eject_after_failures` in a row eject it for
  `eject_s`; any answer resets the count;
- a request that got no byte from its engine for `first_byte_s` makes the router probe the engine's
  `/readyz` (a fresh connection, `probe_timeout_s`; any HTTP answer counts as alive: a busy engine still answers
  its probe). No answer: the backend is ejected until a probe answers again (probed every `probe_timeout_s`
  in the background) and the caller moves the request, nothing of which reached its client, elsewhere.
  Concurrent waiters share one probe per backend.

Data flow: proxy (failures, successes, silences) -> `Health` -> `Backend.ejected_until` / `Backend.failures`
-> `Routes.serving` leaves ejected backends out; a re-admitted backend wakes held requests (`Routes.wake`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time

from kascade_router.backends import Backend, Routes

log = logging.getLogger(__name__)


class Health:
    def __init__(self, routes: Routes, eject_s: float, eject_after_failures: int, probe_timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.routes, self.eject_s, self.after = routes, eject_s, eject_after_failures
        self.probe_timeout_s, self.tls = probe_timeout_s, tls
        self._probes: dict[str, asyncio.Future[bool]] = {}
        self._watch: dict[str, asyncio.Task[None]] = {}
        self.ejections = 0  # a count for tests and logs

    def succeeded(self, b: Backend) -> None:
        b.failures = 0

    def failed(self, b: Backend, refused: bool, why: str) -> None:
        """A connection to `b` failed before any answer."""
        b.failures += 1
        if refused or b.failures >= self.after:
            self._eject(b, time.monotonic() + self.eject_s,
                        f"{why} ({'refused' if refused else f'{b.failures} failures in a row'})")

    async def alive(self, b: Backend) -> bool:
        """Does `b` answer a /readyz probe? Callers waiting at once share one probe."""
        fut = self._probes.get(b.address)
        if fut is None:
            fut = asyncio.ensure_future(self._probe(b.address))
            self._probes[b.address] = fut
            fut.add_done_callback(lambda _: self._probes.pop(b.address, None))
        return await asyncio.shield(fut)

    def hung(self, b: Backend, why: str) -> None:
        """`b` accepted a request and answers nothing, not even its probe: out until a probe answers."""
        if b.usable(time.monotonic()):
            self._eject(b, math.inf, why)
        if b.address not in self._watch:
            self._watch[b.address] = asyncio.create_task(self._readmit(b), name=f"readmit {b.pod}")

    async def close(self) -> None:
        for t in list(self._watch.values()):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._watch.clear()

    def _eject(self, b: Backend, until: float, why: str) -> None:
        self.ejections += 1
        b.ejected_until = until
        log.warning("backend %s (%s) ejected %s: %s", b.pod, b.address,
                    "until it answers a probe" if until == math.inf else f"for {self.eject_s:g} s", why)

    async def _readmit(self, b: Backend) -> None:
        try:
            while b.ejected_until == math.inf:
                await asyncio.sleep(self.probe_timeout_s)
                if await self.alive(b) and b.ejected_until == math.inf:
                    b.ejected_until, b.failures = 0.0, 0
                    log.warning("backend %s (%s) answers its probe again: back in", b.pod, b.address)
                    self.routes.wake()
        finally:
            self._watch.pop(b.address, None)

    async def _probe(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        w: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                r, w = await asyncio.open_connection(host.strip("[]"), int(port), ssl=self.tls,
                                                     server_hostname="" if self.tls is not None else None)
                w.write(f"GET /readyz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
                line = await r.readline()
                return line.startswith(b"HTTP/1.")
        except (OSError, TimeoutError, ValueError):
            return False
        finally:
            if w is not None:
                w.close()
