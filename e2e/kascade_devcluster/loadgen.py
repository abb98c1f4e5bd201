"""A closed-loop load generator for a ModelService's engines: what a router in front of the service
would send, here from a few threads on loopback.

Data flow: `endpoints()` (the ready engines, e.g. pods labelled with the service and annotated
`kascade.io/loaded=true`) is refreshed by one thread -> `workers` threads each loop: pick the next
endpoint round robin, stream a completion (SSE), record TTFT and end-to-end latency -> `results`.
A 503 (engine draining, released or still loading) is retried on the next endpoint, as a router
would; only a request that fails on every try counts as failed. `think_s` between requests sets
the load; `set_load()` changes it on the fly (a burst, then calm).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    start: float  # monotonic
    end: float
    ok: bool
    endpoint: str
    ttft_s: float | None
    tokens: int
    error: str = ""


class LoadGen:
    def __init__(self, endpoints: Callable[[], list[str]], model: str, prompt: list[int], max_tokens: int = 8,
                 refresh_s: float = 0.25, tries: int = 4) -> None:
        self._endpoints_fn, self.model, self.prompt, self.max_tokens = endpoints, model, prompt, max_tokens
        self.refresh_s, self.tries = refresh_s, tries
        self.results: list[Result] = []
        self._eps: list[str] = []
        self._rr = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._active, self._think = 0, 0.0

    def start(self, max_workers: int = 8) -> LoadGen:
        self._threads = [threading.Thread(target=self._refresher, daemon=True)]
        self._threads += [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(max_workers)]
        for t in self._threads:
            t.start()
        return self

    def set_load(self, workers: int, think_s: float = 0.0) -> None:
        """`workers` concurrent clients, each pausing `think_s` between requests (0 workers: idle)."""
        with self._lock:
            self._active, self._think = workers, think_s

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._eps)

    def _refresher(self) -> None:
        while not self._stop.is_set():
            try:
                eps = sorted(self._endpoints_fn())
                with self._lock:
                    self._eps = eps
            except Exception as e:  # a failed discovery keeps the last known endpoints
                log.warning("endpoint discovery failed: %s", e)
            self._stop.wait(self.refresh_s)

    def _next(self) -> str | None:
        with self._lock:
            if not self._eps:
                return None
            self._rr += 1
            return self._eps[self._rr % len(self._eps)]

    def _worker(self, i: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(30.0)) as client:
            while not self._stop.is_set():
                with self._lock:
                    active, think = self._active, self._think
                if i >= active or not self.endpoints():
                    self._stop.wait(0.05)
                    continue
                r = self._one(client)
                with self._lock:
                    self.results.append(r)
                if think:
                    self._stop.wait(think)

    def _one(self, client: httpx.Client) -> Result:
        t0, err, ep = time.monotonic(), "", ""
        for _ in range(self.tries):
            ep = self._next() or ""
            if not ep:
                break
            body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}
            try:
                ttft, n = None, 0
                with client.stream("POST", f"http://{ep}/v1/completions", json=body) as resp:
                    if resp.status_code == 503:
                        err = f"{ep}: 503 {resp.read().decode(errors='replace')[:200]}"
                        continue
                    if resp.status_code != 200:
                        return Result(t0, time.monotonic(), False, ep, None, 0,
                                      f"{ep}: HTTP {resp.status_code} {resp.read().decode(errors='replace')[:200]}")
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return Result(t0, time.monotonic(), False, ep, ttft, n, f"{ep}: {chunk['error']}")
                        n += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
                return Result(t0, time.monotonic(), True, ep, ttft, n)
            except httpx.HTTPError as e:
                err = f"{ep}: {type(e).__name__}: {e}"
        return Result(t0, time.monotonic(), False, ep, None, 0, err or "no ready endpoint")

    def summary(self, since: float = 0.0) -> dict[str, float]:
        with self._lock:
            rs = [r for r in self.results if r.start >= since]
        ok = [r for r in rs if r.ok]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        return {"requests": len(rs), "ok": len(ok), "failed": len(rs) - len(ok),
                "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else 0.0,
                "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else 0.0}
