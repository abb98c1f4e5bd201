"""Demand per model as this router sees it: queued (held) and in-flight requests, request and token
counters, and rates over a sliding window. It is what the operator scales on when no engine exists
(scale from zero) and what Prometheus scrapes (`kascade_router_*`).

Data flow: the proxy bumps plain counters on `ModelDemand` (no locks, one event loop) -> `/metrics`
renders them through a prometheus-client collector at scrape time; `/router/v1/demand` returns them as
JSON with rates over the last `window_s` (the operator reads that).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass
class ModelDemand:
    namespace: str
    service: str
    model: str
    queued: int = 0
    in_flight: int = 0
    requests: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    input_tokens: int = 0
    output_tokens: int = 0
    # requests a converted decoder was to prefill itself and handed to the prefill engine the router named
    # (X-Kascade-Handed-Back on its answer)
    handbacks: int = 0
    last_request: float = 0.0  # monotonic time of the last arrival
    _arrivals: deque[tuple[float, int]] = field(default_factory=deque)  # (time, output tokens) per finished request

    def arrived(self, now: float) -> None:
        self.last_request = now

    def finished(self, status: int, input_tokens: int, output_tokens: int, now: float) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self._arrivals.append((now, input_tokens + output_tokens))

    def rates(self, now: float, window_s: float) -> tuple[float, float]:
        """(requests/s, tokens/s) finished over the last `window_s`."""
        q = self._arrivals
        while q and q[0][0] < now - window_s:
            q.popleft()
        return len(q) / window_s, sum(t for _, t in q) / window_s


class Demand:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.models: dict[tuple[str, str], ModelDemand] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    def of(self, svc: tuple[str, str], model: str) -> ModelDemand:
        d = self.models.get(svc)
        if d is None:
            d = self.models[svc] = ModelDemand(svc[0], svc[1], model)
        return d

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        t = time.monotonic() if now is None else now
        out = {}
        for (ns, name), d in self.models.items():
            rps, tps = d.rates(t, self.window_s)
            out[f"{ns}/{name}"] = {"namespace": ns, "modelService": name, "model": d.model, "queued": d.queued,
                                   "inFlight": d.in_flight, "requestsPerSecond": rps, "tokensPerSecond": tps,
                                   "idleSeconds": t - d.last_request if d.last_request else None}
        return {"windowSeconds": self.window_s, "models": out}


class _Collector(Collector):
    def __init__(self, demand: Demand) -> None:
        self.demand = demand

    def collect(self) -> Iterator[Any]:
        lab = ["namespace", "model_service", "model"]
        queued = GaugeMetricFamily("kascade_router_queued_requests", "Requests held for a model with no serving "
                                   "replica", labels=lab)
        flight = GaugeMetricFamily("kascade_router_in_flight_requests", "Requests being proxied", labels=lab)
        rps = GaugeMetricFamily("kascade_router_request_rate", "Requests finished per second over the window",
                                labels=lab)
        tps = GaugeMetricFamily("kascade_router_token_rate", "Prompt + completion tokens per second over the window",
                                labels=lab)
        reqs = CounterMetricFamily("kascade_router_requests", "Requests answered, by HTTP status",
                                   labels=[*lab, "code"])
        toks = CounterMetricFamily("kascade_router_tokens", "Tokens (prompt: estimated for text) by kind",
                                   labels=[*lab, "kind"])
        hb = CounterMetricFamily("kascade_router_prefill_handbacks", "Prompts a converted decoder handed to the "
                                 "prefill engine the router named", labels=lab)
        now = time.monotonic()
        for d in list(self.demand.models.values()):
            v = [d.namespace, d.service, d.model]
            queued.add_metric(v, d.queued)
            flight.add_metric(v, d.in_flight)
            r, t = d.rates(now, self.demand.window_s)
            rps.add_metric(v, r)
            tps.add_metric(v, t)
            for code, n in d.requests.items():
                reqs.add_metric([*v, str(code)], n)
            toks.add_metric([*v, "input"], d.input_tokens)
            toks.add_metric([*v, "output"], d.output_tokens)
            hb.add_metric(v, d.handbacks)
        yield from (queued, flight, rps, tps, reqs, toks, hb)
