"""A work queue keyed by ModelService (controller-runtime's workqueue model, in asyncio): rounds run when
a service's inputs change or its resync period expires, never one timer per service.

Semantics:
- `add(key, delay, urgent)`: the key is due `delay` seconds from now. A key is queued at most once: adding
  it again keeps the earlier due time (a burst of events is one round) and stays urgent once made urgent.
- Urgent keys (an input changed: a metric, a pod, a plan, the spec) are taken before every non-urgent one
  (a resync or the next tick of a moving service), earliest due first within each class: however many
  resyncs are due, a service whose inputs changed waits only for a free worker. At most `background`
  non-urgent rounds run at once (default half the workers): rounds share one event loop, so a wave
  of resyncs running beside a crossing service's round would slow every await of it.
- A key is never processed by two workers at once: added while its round runs, it is due again after
  that round (the round may have read inputs from before the change).
- `workers` tasks take due keys, earliest due first, and call `process(key)`. A round that raises is
  retried after an exponential backoff per key (`base_backoff_s` doubling up to `max_backoff_s`), reset
  by the key's next successful round.
- `forget(key)` drops a key (its service was deleted).
- `held(key)`: a round of that key runs outside the queue (a kopf change handler's, under the service's lock):
  meanwhile the workers leave the key queued, as while one of them runs it, and take other keys. A worker
  taking it instead waited on that lock for the handler's whole round (a creating round's instruct: 10 s and
  more while 200 services were created at once), and with every worker so blocked no other service's round
  started: rounds 5-37 s late at 2,000 nodes / 200 services (issue 33).
Busy services never wait behind idle ones: only due keys are taken, idle services are not due, and an
input change goes ahead of every due resync.
Lateness: `on_take(key, late_s, urgent)` is told, for every round taken, how long after its due time it
started; `overdue(tolerance_s)` counts queued keys already later than that (rounds due but not delivered).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator

Entry = tuple[float, int, Hashable]  # (due, seq, key) in a heap; stale entries are skipped

log = logging.getLogger(__name__)


class WorkQueue:
    def __init__(self, process: Callable[[Hashable], Awaitable[None]], workers: int = 4,
                 base_backoff_s: float = 0.1, max_backoff_s: float = 30.0,
                 on_take: Callable[[Hashable, float, bool], None] | None = None,
                 background: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._background = max(1, workers // 2) if background is None else background
        if self._background < 1:
            raise ValueError(f"background must be >= 1, got {background}")
        self._running_background: set[Hashable] = set()
        self._process = process
        self._n = workers
        self._base, self._max = base_backoff_s, max_backoff_s
        self._due: dict[Hashable, tuple[float, bool]] = {}  # key -> (monotonic due time, urgent); queued only
        self._heaps: dict[bool, list[Entry]] = {True: [], False: []}  # urgent first
        self._on_take = on_take
        self._seq = 0
        self._running: set[Hashable] = set()
        self._held: dict[Hashable, int] = {}  # key -> rounds of it running outside the queue (`held`)
        self._failures: dict[Hashable, int] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.processed = 0

    def add(self, key: Hashable, delay: float = 0.0, urgent: bool = False) -> None:
        due = time.monotonic() + max(0.0, delay)
        old = self._due.get(key)
        if old is not None:
            due, urgent = min(due, old[0]), urgent or old[1]
            if (due, urgent) == old:
                return
        self._due[key] = (due, urgent)
        self._seq += 1
        heapq.heappush(self._heaps[urgent], (due, self._seq, key))
        self._wake.set()

    def forget(self, key: Hashable) -> None:
        self._due.pop(key, None)
        self._failures.pop(key, None)

    @contextlib.contextmanager
    def held(self, key: Hashable) -> Iterator[None]:
        """While the block runs (a round of `key` outside the queue), no worker takes `key`; due meanwhile, it
        is taken after the block."""
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield
        finally:
            n = self._held.pop(key) - 1
            if n:
                self._held[key] = n
            elif key in self._due:
                self._wake.set()

    def due_in(self, key: Hashable) -> float | None:
        """Seconds until the key is due (None: not queued)."""
        entry = self._due.get(key)
        return None if entry is None else entry[0] - time.monotonic()

    def urgent(self, key: Hashable) -> bool:
        """Whether the key is queued as an input change."""
        entry = self._due.get(key)
        return entry is not None and entry[1]

    def overdue(self, tolerance_s: float) -> int:
        """Queued keys (not running) whose due time passed more than `tolerance_s` ago. Read by a gauge, so from the
        metrics server's thread while the loop changes the queue: over a snapshot (a loop over the dict itself
        raised "dictionary changed size during iteration" and lost the whole scrape). list() of a dict view
        allocates no GC object mid-copy, so no other thread runs inside it."""
        limit = time.monotonic() - tolerance_s
        return sum(1 for due, _ in list(self._due.values()) if due < limit)

    def __len__(self) -> int:
        return len(self._due)

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker(), name=f"workqueue-{i}") for i in range(self._n)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    def _take(self) -> tuple[Hashable | None, float]:
        """The due key to run next (removed from the queue): urgent ones first, else the earliest due
        non-urgent one; (None, seconds until one is due) when none is."""
        wait = 3600.0
        for urgent in (True, False):
            if not urgent and len(self._running_background) >= self._background:
                break  # woken again when a background round ends
            key, w = self._take_from(urgent)
            if key is not None:
                if not urgent:
                    self._running_background.add(key)
                return key, 0.0
            wait = min(wait, w)
        return None, wait

    def _take_from(self, urgent: bool) -> tuple[Hashable | None, float]:
        heap = self._heaps[urgent]
        now = time.monotonic()
        deferred: list[Entry] = []
        got: Hashable | None = None
        wait = 3600.0
        while heap:
            due, seq, key = heap[0]
            if self._due.get(key) != (due, urgent):
                heapq.heappop(heap)  # stale: re-added earlier or as urgent, forgotten, or taken
                continue
            if due > now:
                wait = due - now
                break
            heapq.heappop(heap)
            if key in self._running or key in self._held:
                deferred.append((due, seq, key))  # due again once its running round ends
                continue
            del self._due[key]
            if self._on_take is not None:
                self._on_take(key, now - due, urgent)
            got = key
            break
        for d in deferred:
            heapq.heappush(heap, d)
        return got, wait

    async def _worker(self) -> None:
        while True:
            key, wait = self._take()
            if key is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
                continue
            self._running.add(key)
            try:
                await self._process(key)
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception:
                n = self._failures.get(key, 0)
                self._failures[key] = n + 1
                delay = min(self._max, self._base * 2 ** n)
                log.exception("round of %s failed (retry in %.1f s)", key, delay)
                self.add(key, delay)
            finally:
                self._running.discard(key)
                if key in self._running_background:
                    self._running_background.discard(key)
                    self._wake.set()  # a background slot is free
                self.processed += 1
                if key in self._due:
                    self._wake.set()  # added while it ran: another worker may take it now
