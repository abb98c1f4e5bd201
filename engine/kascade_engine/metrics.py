"""Engine metrics (prometheus-client, prefix `kascade_`, names per DESIGN.md §6), in a registry owned
by the engine instance (no module globals).

Data flow: Serving calls `on_request` (prompt admitted), `observe_event` (every token), `observe_ttft`;
`update(instance)` samples the gauges (queue, running, KV use, residency, transfer) before a scrape.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.queue_length = Gauge("kascade_queue_length", "Requests waiting for prefill", registry=r)
        self.running = Gauge("kascade_running_requests", "Requests being decoded", registry=r)
        self.input_tokens = Counter("kascade_input_tokens", "Prompt tokens accepted", registry=r)
        self.output_tokens = Counter("kascade_output_tokens", "Tokens generated", registry=r)
        self.kv_usage = Gauge("kascade_kv_cache_usage", "Fraction of the KV token budget reserved", registry=r)
        self.ttft = Histogram("kascade_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tbt = Histogram("kascade_tbt_seconds", "Time between tokens", registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.blocks_resident = Gauge("kascade_blocks_resident", "Weight blocks resident", registry=r)
        self.transfer_bytes = Gauge("kascade_transfer_bytes", "Weight bytes received by the data plane", registry=r)
        self.transfer_bw = Gauge("kascade_transfer_bandwidth_bytes_per_second",
                                 "Weight bytes received / seconds since the first byte of the current load", registry=r)
        self.live_split = Counter("kascade_live_split_requests", "Requests served split with a peer while loading",
                                  registry=r)
        self.live_layers = Gauge("kascade_live_layers", "Layers executed for a cooperating peer", registry=r)
        self._last_token: dict[str, float] = {}

    def on_request(self, prompt_tokens: int) -> None:
        self.input_tokens.inc(prompt_tokens)

    def observe_event(self, ev: Any, now: float) -> None:
        if ev.token < 0:
            self._last_token.pop(ev.request, None)
            return
        self.output_tokens.inc()
        prev = self._last_token.get(ev.request)
        if prev is not None:
            self.tbt.observe(now - prev)
        if ev.finished:
            self._last_token.pop(ev.request, None)
        else:
            self._last_token[ev.request] = now

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def update(self, inst: Any) -> None:
        s = inst.engine.scheduler
        self.queue_length.set(len(s.waiting))
        self.running.set(len(s.running))
        self.kv_usage.set(s.kv_reserved() / s.limits.kv_tokens)
        self.blocks_resident.set(len(inst.model.weights))
        self.transfer_bytes.set(inst.bytes_received)
        self.transfer_bw.set(inst.transfer_bw)
        self.live_layers.set(inst.finisher.layers_finished)
