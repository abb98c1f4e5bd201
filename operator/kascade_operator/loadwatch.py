"""Load watches: one held long-poll per serving engine that the engine answers the moment its prompt
tokens/s leaves a band around the operator's last reading (kascade_planner.loadwatch has the wire), so a
crossing wakes its service's round within a tick of the engine, not up to one sweep interval later.

Data flow: the sweep (rounds.sweep_forever) passes every serving engine to `LoadWatchers.sync` -> one task
per (group, instance, endpoint), ended when the engine stops serving the group -> `band_around(the
instance's tokens/s in the view's reading)` -> `Scraper.watch` (held GET) -> answered before the wait
ran out -> `on_left(group, instance, answer)` (rounds: the answer, a /metrics text, updates that engine's
load in the view -> its round is woken if the group's loads changed) ->
re-armed around the new reading. The sweep stays as the resync: a watch that fails, an engine that
answers a watch at once (an older engine ignores the query) or a band left without the group's loads
changing re-arms only after one interval, so a watch never costs more than the sweep's own rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from kascade_operator.metrics import Scraper
from kascade_operator.metricsview import Group, MetricsView
from kascade_operator.scrapeconn import ScrapeError
from kascade_planner.loadwatch import band_around

log = logging.getLogger(__name__)

Watched = tuple[Group, str, str]  # (group, instance, endpoint)
MIN_GAP_S = 0.05  # one engine's watch is re-armed at most this often


class LoadWatchers:
    def __init__(self, scraper: Scraper, view: MetricsView, wait_s: float, window_s: float, interval_s: float,
                 on_left: Callable[[Group, str, str], bool]) -> None:
        """`on_left(group, instance, its /metrics text)`: take the answer into the view and wake the group's round
        when its loads changed (returns whether they did)."""
        self.scraper, self.view = scraper, view
        self.wait_s, self.window_s, self.interval_s = wait_s, window_s, interval_s
        self.on_left = on_left
        self._tasks: dict[Watched, asyncio.Task[None]] = {}
        self.answered = 0  # watches answered before their wait ran out (the band was left)

    def tps(self, group: Group, instance: str) -> float:
        r = self.view.reading(group)
        return next((x.input_tokens_per_s for x in r.loads if x.instance == instance), 0.0) if r else 0.0

    async def _watch(self, w: Watched) -> None:
        group, instance, endpoint = w
        while True:
            band = band_around(self.tps(group, instance), max(self.window_s, 0.05), self.wait_s)
            t0 = time.monotonic()
            try:
                text = await self.scraper.watch(endpoint, band)
            except ScrapeError as e:
                log.debug("load watch of %s (%s): %s", instance, endpoint, e)
                await asyncio.sleep(self.interval_s)
                continue
            if time.monotonic() - t0 >= self.wait_s:
                continue  # the wait ran out: nothing moved
            self.answered += 1
            if not self.on_left(group, instance, text):
                await asyncio.sleep(self.interval_s)  # nothing the rounds read moved: not again before the sweep
            else:  # a ramp re-arms at once, but an engine and the operator that disagree on the rate (another
                # window) answer no more than MIN_GAP_S apart: at most 1/MIN_GAP_S rounds a second from a watch
                await asyncio.sleep(max(0.0, t0 + MIN_GAP_S - time.monotonic()))

    def sync(self, groups: Mapping[Group, Mapping[str, str]]) -> None:
        """Watch exactly the engines in `groups` (the sweep's targets)."""
        want = {(g, i, ep) for g, eps in groups.items() for i, ep in eps.items()}
        for w in [w for w in self._tasks if w not in want]:
            self._tasks.pop(w).cancel()
        for w in want - self._tasks.keys():
            self._tasks[w] = asyncio.create_task(self._watch(w), name=f"load-watch {w[1]}")

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
