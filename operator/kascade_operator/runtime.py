"""Everything the handlers share at run time: API client, engine client, metrics source, settings,
per-ModelService memory (scale-down timers), a short-lived node cache, and operator metrics.

Data flow: created once in the kopf startup handler, stored in kopf's memo, closed at cleanup.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kascade_operator.engine_client import EngineClient
from kascade_operator.kube import Kube
from kascade_operator.metrics import PrometheusSource, Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.settings import OperatorSettings

NODE_CACHE_S = 2.0  # node labels change rarely; re-listing 2,000 nodes per decision would dominate


@dataclass
class Runtime:
    settings: OperatorSettings
    kube: Kube
    engines: EngineClient
    scraper: Scraper | None
    prometheus: PrometheusSource | None
    metrics: OperatorMetrics
    below_since: dict[tuple[str, str, str], float | None] = field(default_factory=dict)
    invalid_seen: dict[tuple[str, str], int] = field(default_factory=dict)  # (ns, name) -> generation reported
    plan_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    instructed: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # this process's record
    _nodes: list[dict[str, Any]] = field(default_factory=list)
    _nodes_t: float = -1e9

    async def nodes(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if now - self._nodes_t > NODE_CACHE_S:
            self._nodes, self._nodes_t = await self.kube.list_nodes(), now
        return self._nodes

    def lock(self, ns: str, name: str) -> asyncio.Lock:
        return self.plan_locks.setdefault((ns, name), asyncio.Lock())

    async def close(self) -> None:
        await self.engines.aclose()
        if self.scraper:
            await self.scraper.aclose()
        if self.prometheus:
            await self.prometheus.aclose()
        await self.kube.close()
