"""Host memory: which models each host keeps in DRAM (ServerlessLLM-style caching), under a budget.

Data flow: the simulator asks `warm(host, model, now)` when planning a load (hit: PCIe from DRAM,
miss: the local SSD), reports `loaded(host, model, t)` when an SSD load completes (only then is the
copy usable: ServerlessLLM stages a checkpoint through pinned host memory, and a half-read copy
cannot serve another load), `in_use` / `released` as instances come and go. A copy no instance uses
expires `keep_alive_s` after the last one left (TTL); when a new copy does not fit the per-host
budget, copies are evicted least recently used first, unused ones before used ones. Every lookup
counts as a hit or a miss (`miss_rate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Copy:
    ready_s: float
    used_s: float  # last time a load read it or an instance started from it
    users: int = 0
    expires_s: float = math.inf


class HostMemory:
    def __init__(self, hosts: list[str], budget_bytes: float, model_bytes: int, keep_alive_s: float) -> None:
        self.copies: dict[str, dict[int, _Copy]] = {h: {} for h in hosts}
        self.budget = budget_bytes
        self.size = model_bytes
        self.keep_alive_s = keep_alive_s
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.peak_copies = 0
        self.touched: set[str] = set()

    def _live(self, host: str, model: int, now: float) -> _Copy | None:
        c = self.copies[host].get(model)
        if c is None:
            return None
        if c.users == 0 and c.expires_s <= now:
            del self.copies[host][model]
            return None
        return c

    def warm(self, host: str, model: int, now: float) -> bool:
        c = self._live(host, model, now)
        return c is not None and c.ready_s <= now

    def lookup(self, host: str, model: int, now: float) -> bool:
        """A load on `host` needs `model`: a counted hit (and an LRU touch) or miss."""
        hit = self.warm(host, model, now)
        if hit:
            self.hits += 1
            self.copies[host][model].used_s = now
        else:
            self.misses += 1
        return hit

    def count(self, now: float) -> int:
        return sum(1 for h in self.copies for m in list(self.copies[h]) if self._live(h, m, now) is not None)

    def in_use(self, host: str, model: int, now: float) -> None:
        c = self._live(host, model, now)
        if c is not None:
            c.users += 1
            c.used_s = now
            c.expires_s = math.inf

    def loaded(self, host: str, model: int, now: float, users: int = 1) -> None:
        """An SSD load finished: the copy is now in DRAM (evicting others if the budget needs it)."""
        c = self._live(host, model, now)
        if c is not None:
            return
        fits = int(self.budget // self.size) if math.isfinite(self.budget) else math.inf
        if fits < 1:
            return  # a copy does not fit at all: nothing is cached
        held = self.copies[host]
        while len(held) >= fits:
            victim = min(held, key=lambda m: (held[m].users > 0, held[m].used_s, m))
            del held[victim]
            self.evictions += 1
        held[model] = _Copy(now, now, users, math.inf if users else now + self.keep_alive_s)
        self.touched.add(host)
        self.peak_copies = max(self.peak_copies, sum(len(v) for v in self.copies.values()))

    def released(self, host: str, model: int, now: float) -> None:
        c = self.copies[host].get(model)
        if c is None:
            return
        c.users = max(0, c.users - 1)
        if c.users == 0:
            c.expires_s = now + self.keep_alive_s

    @property
    def miss_rate(self) -> float:
        total = self.hits + self.misses
        return self.misses / total if total else 0.0
