"""A closed-loop load generator that sends every request through the router's OpenAI endpoint with the
official `openai` client, as a user's application would; no client-side routing or retries (choosing a
replica, retrying one that failed before answering, holding while scaling from zero: the router's job).

Data flow: `workers` threads each loop: stream a completion from `base_url` (SSE), record TTFT,
end-to-end latency and which replica answered (the router's `X-Kascade-Replica` header) -> `results`.
`think_s` between requests sets the load; `set_load()` changes it on the fly (a burst, then calm).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import openai

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    start: float  # monotonic
    end: float
    ok: bool
    endpoint: str  # the replica (pod) that answered, per the router
    ttft_s: float | None
    tokens: int
    error: str = ""


class LoadGen:
    def __init__(self, base_url: str, model: str, prompt: list[int], max_tokens: int = 8,
                 timeout_s: float = 120.0) -> None:
        self.base_url, self.model, self.prompt, self.max_tokens = base_url.rstrip("/"), model, prompt, max_tokens
        self.timeout_s = timeout_s
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._active, self._think = 0, 0.0

    def start(self, max_workers: int = 8) -> LoadGen:
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(max_workers)]
        for t in self._threads:
            t.start()
        return self

    def set_load(self, workers: int, think_s: float = 0.0) -> None:
        """`workers` concurrent clients, each pausing `think_s` between requests (0 workers: idle)."""
        with self._lock:
            self._active, self._think = workers, think_s

    def stop(self) -> None:
        """No new requests; in-flight ones finish (a caller that stops the router next must not turn them
        into failures: each gets its own timeout to end)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def failures(self) -> list[str]:
        with self._lock:
            return [r.error for r in self.results if not r.ok]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="kascade", max_retries=0, timeout=self.timeout_s)

    def _worker(self, i: int) -> None:
        with self.client() as client:
            while not self._stop.is_set():
                with self._lock:
                    active, think = self._active, self._think
                if i >= active:
                    self._stop.wait(0.05)
                    continue
                r = self.one(client)
                with self._lock:
                    self.results.append(r)
                if think:
                    self._stop.wait(think)

    def one(self, client: openai.OpenAI) -> Result:
        t0, replica, ttft, n = time.monotonic(), "", None, 0
        try:
            raw = client.completions.with_raw_response.create(model=self.model, prompt=self.prompt,
                                                              max_tokens=self.max_tokens, stream=True)
            replica = raw.headers.get("x-kascade-replica", "")
            for chunk in raw.parse():
                if chunk.choices and ttft is None:
                    ttft = time.monotonic() - t0
                n += len(chunk.choices)
            return Result(t0, time.monotonic(), True, replica, ttft, n)
        except openai.OpenAIError as e:
            return Result(
                t0, time.monotonic(), False, replica, ttft, n, f"{replica or 'router'}: {type(e).__name__}: {e}"
            )

    def summary(self, since: float = 0.0) -> dict[str, float]:
        with self._lock:
            rs = [r for r in self.results if r.start >= since]
        ok = [r for r in rs if r.ok]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        return {
            "requests": len(rs),
            "ok": len(ok),
            "failed": len(rs) - len(ok),
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else 0.0,
            "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else 0.0,
            "ttft_max_ms": 1000 * ttfts[-1] if ttfts else 0.0,
        }
