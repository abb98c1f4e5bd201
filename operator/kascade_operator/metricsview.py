"""One metrics pipeline for every ModelService: a shared sweep scrapes each serving engine once per
interval, with bounded concurrency, into an in-memory view that every service's round reads.

Data flow: the watch-fed pod index -> `targets()` (group (namespace, service, role) -> instance ->
endpoint; bound, ready, undrained pods) -> `MetricsView.sweep` (the `Scraper`, one RateTracker per
group as before, at most `concurrency` groups in flight) -> per group the loads and when they were
taken -> `changed` groups (their loads differ from the previous sweep's), each handed to `on_change` as
soon as its own scrape is in -> the caller queues an urgent round for those services (workqueue.py).
A round reads `collect()`: the view's loads when they are fresh (within a period plus the last sweep's
length) and cover the round's instances, else a scrape of just those instances now (a pod bound since the
last sweep, or no sweep running: tests that drive rounds directly).

Cost: a round reads its own groups only (no HTTP when the view is fresh), so its cost does not grow
with the number of other services; the sweep is O(engines) per interval, as scraping must be.
Idle engines report the same loads sweep after sweep, so an idle service gets no round from the sweep.
Between sweeps, a load watch (loadwatch.py) that an engine answers hands its /metrics text to
`answered(group, instance, text)`: that engine's load is updated at once and its round woken when the
group's loads changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kascade_operator.metrics import InstanceLoad, Scraper
from kascade_operator.pool import PodView

Group = tuple[str, str, str]  # (service namespace, service name, role)


def group_of(p: PodView, pool_ns: str) -> Group | None:
    """The (namespace, service, role) whose load pod `p` carries, or None when it serves none now."""
    if p.model_service is None or p.role is None or p.draining or not p.ready or not p.endpoint:
        return None
    ns, _, name = p.model_service.rpartition("/")  # pool.service_key: "ns/name" across namespaces
    return (ns or pool_ns, name, p.role)


def targets(pods_by_pool_ns: Mapping[str, Iterable[PodView]]) -> dict[Group, dict[str, str]]:
    """Every serving engine, grouped as the rounds read them."""
    out: dict[Group, dict[str, str]] = {}
    for pool_ns, pods in pods_by_pool_ns.items():
        for p in pods:
            g = group_of(p, pool_ns)
            if g is not None and p.endpoint:
                out.setdefault(g, {})[p.instance] = p.endpoint
    return out


@dataclass(frozen=True)
class Reading:
    taken_s: float  # monotonic
    endpoints: tuple[tuple[str, str], ...]  # sorted (instance, endpoint) scraped
    loads: tuple[InstanceLoad, ...]


class MetricsView:
    def __init__(self, scraper: Scraper, max_age_s: float, concurrency: int = 32) -> None:
        self.scraper = scraper
        self.max_age_s = max_age_s
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self._readings: dict[Group, Reading] = {}
        self.sweeps = 0
        self.last_sweep_s = 0.0  # seconds the last sweep took

    def reading(self, group: Group) -> Reading | None:
        return self._readings.get(group)

    async def _scrape(self, group: Group, endpoints: Mapping[str, str]) -> Reading:
        async with self._sem:
            loads = await self.scraper.collect(endpoints, group)
        r = Reading(time.monotonic(), tuple(sorted(endpoints.items())), tuple(loads))
        self._readings[group] = r
        return r

    async def sweep(self, groups: Mapping[Group, Mapping[str, str]],
                    on_change: Callable[[Group], None] | None = None) -> set[Group]:
        """Scrape every group once; returns the groups whose loads changed since their previous reading
        (new groups included), each also passed to `on_change` the moment its scrape is in (a crossing
        is acted on without waiting for the rest of the sweep). Groups no longer serving are forgotten."""
        t0 = time.monotonic()
        before = {g: r.loads for g, r in self._readings.items()}

        async def one(g: Group, eps: Mapping[str, str]) -> Reading:
            r = await self._scrape(g, eps)
            if on_change is not None and before.get(g) != r.loads:
                on_change(g)
            return r

        got = await asyncio.gather(*(one(g, eps) for g, eps in groups.items()))
        for g in [g for g in self._readings if g not in groups]:
            del self._readings[g]
            self.scraper.rates.pop(g, None)
        self.sweeps += 1
        self.last_sweep_s = time.monotonic() - t0
        return {g for g, r in zip(groups, got, strict=True) if before.get(g) != r.loads}

    def answered(self, group: Group, instance: str, text: str) -> bool:
        """A load watch's answer (the /metrics text of one of the group's engines, read now) taken into the
        group's reading; whether its loads changed. The reading keeps its time (the other engines' loads are
        as old as they were)."""
        r = self._readings.get(group)
        if r is None or instance not in dict(r.endpoints):
            return False
        load = self.scraper.load_of(group, instance, text)
        if load is None:
            return False
        loads = tuple(load if x.instance == instance else x for x in r.loads)
        if load not in loads:  # its scrape had failed: it joins the reading
            loads = (*loads, load)
        self._readings[group] = Reading(r.taken_s, r.endpoints, loads)
        return loads != r.loads

    def fresh(self, r: Reading, now: float) -> bool:
        """Whether a reading is as fresh as the sweep keeps it: taken within `max_age_s` (the sweep's period) plus
        the last sweep's length. A sweep that takes longer (1,000 engines, a slow engine, a loaded machine) then
        does not turn every round into a scrape of its own: at 1,000 services on slow engines those scrapes
        doubled the traffic to them and held the queue's workers until they timed out (rounds started 200 s
        late). A change still wakes its round the moment the sweep or a load watch sees it."""
        return now - r.taken_s <= self.max_age_s + self.last_sweep_s

    async def collect(self, endpoints: Mapping[str, str], group: Group) -> list[InstanceLoad]:
        """The group's loads for a round: the view's when fresh and over the same instances, else scraped now."""
        r = self._readings.get(group)
        if r is not None and self.fresh(r, time.monotonic()) and r.endpoints == tuple(sorted(endpoints.items())):
            return list(r.loads)
        if not endpoints:
            return []
        return list((await self._scrape(group, endpoints)).loads)
