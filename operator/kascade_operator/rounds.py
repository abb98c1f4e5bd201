"""When a ModelService gets a round: event-driven, through one work queue (workqueue.py), not a timer per
service.

Data flow:
- inputs change -> `wake(ns, name)`, queued as urgent (ahead of every resync, workqueue.py): its spec (kopf
  change handlers run a round directly, then `after_round`), a pod bound to it or one of its ScalePlans
  changed (kopf event handlers): due at once, but never sooner than 0.95 of the service's interval after
  its last round (rate limit: its own writes come back as pod events; the round skips ticks that come
  sooner). Its metrics changed (the shared sweep, `sweep_forever` -> metricsview.py, the moment that
  engine's scrape is in, not after the whole sweep): `wake(..., metrics=True)`, due at once, no rate limit
  (the sweep itself wakes a service at most once per interval), and its round is not skipped
  (`Runtime.metric_woken`). Between sweeps, a held load watch per engine (loadwatch.py) that the engine
  answers when its tokens/s leaves a band scrapes that group at once and wakes it the same way.
- after every round, `after_round` queues the next one: one interval later while the service is moving
  (a plan runs, a pod drains, a scale-down delay or an idle-to-zero clock is counting, the pool is short,
  or its metrics come from Prometheus, which the sweep does not watch), else after `resync_seconds` (plus up to
  10%: services started together spread their resyncs instead of one wave each period).
- the queue's workers run `round_of(key)` (handlers.py: the service's body from the watch-fed index ->
  `reconcile_service`); a round that raises is retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import cast

from kascade_operator import trace
from kascade_operator.loadwatch import LoadWatchers
from kascade_operator.metricsview import Group, MetricsView, targets
from kascade_operator.runtime import Runtime
from kascade_operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name) of a ModelService


def service_of(model_service: str, pool_ns: str) -> Key:
    """A pod's kascade.io/model-service value (pool.service_key) -> the service's (namespace, name)."""
    ns, _, name = model_service.rpartition("/")
    return (ns or pool_ns, name)


def wake(rt: Runtime, ns: str, name: str, metrics: bool = False) -> None:
    """Queue an urgent round for the service: now when its metrics changed (`metrics`), else now or once its
    rate limit allows."""
    if rt.queue is None or not rt.owns(ns):  # another shard's service (shardset.py): dropped here
        return
    key = (ns, name)
    if metrics:
        rt.metric_woken.add(key)
        trace.event("wake", key)
        rt.queue.add(key, 0.0, urgent=True)
        return
    interval, _ = rt.steady.get(key, (rt.settings.interval_seconds, False))
    last = rt.last_round.get(key)
    delay = 0.0 if last is None else max(0.0, last + 0.95 * interval - time.monotonic() + 0.001)
    rt.queue.add(key, delay, urgent=True)


def after_round(rt: Runtime, ns: str, name: str) -> None:
    """Queue the service's next round: one interval on while it moves, `resync_seconds` when steady."""
    if rt.queue is None or not rt.owns(ns):
        return
    interval, steady = rt.steady.get((ns, name), (rt.settings.interval_seconds, False))
    # not urgent; a resync 0-10% later than its period, so services started together do not resync together
    rt.queue.add((ns, name), max(interval, rt.settings.resync_seconds) * (1 + 0.1 * random.random()) if steady
                 else interval)


@contextlib.contextmanager
def held(rt: Runtime, ns: str, name: str) -> Iterator[None]:
    """A round of the service that runs outside the queue (a kopf change handler's): the queue's workers leave
    it meanwhile (WorkQueue.held) instead of one of them waiting on the service's lock."""
    if rt.queue is None:
        yield
        return
    with rt.queue.held((ns, name)):
        yield


def forget(rt: Runtime, ns: str, name: str) -> None:
    if rt.queue is not None:
        rt.queue.forget((ns, name))
    rt.steady.pop((ns, name), None)
    rt.metric_woken.discard((ns, name))
    rt.parsed.pop((ns, name), None)
    pool_ns = rt.pool_namespace(ns)
    rt.fleet_board(pool_ns).remove(name if ns == pool_ns else f"{ns}/{name}")  # its ask leaves the arbitration


async def sweep_forever(rt: Runtime, view: MetricsView) -> None:
    """Scrape every serving engine once per interval; wake a service as soon as its loads are seen changed.
    With `load_watch_seconds`, hold a load watch on each of those engines too (loadwatch.py): a crossing
    between sweeps wakes its round at once."""
    period = rt.settings.interval_seconds
    watchers = None
    if rt.scraper is not None and rt.scraper.can_watch and rt.settings.load_watch_seconds > 0:
        def left(g: Group, instance: str, text: str) -> bool:
            changed = view.answered(g, instance, text)
            if changed:
                wake(rt, g[0], g[1], metrics=True)
            return changed

        watchers = LoadWatchers(rt.scraper, view, rt.settings.load_watch_seconds, rt.settings.rate_window_seconds,
                                period, left)
    try:
        while True:
            t0 = time.monotonic()
            try:
                pods = {pns: (await rt.pool_snapshot(pns)).views.values() for pns in rt.pool_namespaces()
                        if rt.shards is None or rt.shards.owns(pns)}  # the engines of the shards held here
                groups = targets(pods)
                await view.sweep(groups, lambda g: wake(rt, g[0], g[1], metrics=True))
                rt.metrics.sweep.observe(view.last_sweep_s)
                if watchers is not None and rt.scraper is not None:
                    watchers.sync(groups)
                    await rt.scraper.prune_watches({ep for eps in groups.values() for ep in eps.values()})
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("metric sweep failed")
            await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))
    finally:
        if watchers is not None:
            await watchers.close()


def start(rt: Runtime, round_of: Callable[[Hashable], Awaitable[None]]) -> None:
    """Start the queue's workers and, when engines are scraped directly, the shared sweep (once)."""
    if rt.queue is not None:
        return
    def took(key: Hashable, late: float, urgent: bool) -> None:
        rt.metrics.queue_wait.labels("change" if urgent else "resync").observe(late)
        trace.event("take", cast(Key, key), f"{late:.3f} {'change' if urgent else 'resync'}")

    rt.queue = WorkQueue(round_of, workers=rt.settings.round_workers, on_take=took)
    rt.metrics.watch_queue(lambda: rt.queue.overdue(rt.settings.interval_seconds) if rt.queue else 0)
    rt.queue.start()
    if rt.scraper is not None and rt.prometheus is None:
        rt.view = MetricsView(rt.scraper, max_age_s=rt.settings.interval_seconds,
                              concurrency=rt.settings.scrape_concurrency)
        rt.sweep_task = asyncio.create_task(sweep_forever(rt, rt.view), name="metric-sweep")
