"""One serving instance inside the simulator: continuous batching over a KV budget.

Data flow: routed requests -> `waiting` (FCFS) -> a prefill iteration (prompt tokens batched up to a
budget, admitted only if their KV fits) -> `running` (a heap keyed by the decode step at which each
finishes) -> decode iterations (one token for every running request). All bookkeeping is O(1) or
O(log n) per iteration so an hour of trace simulates in seconds: a request's TBT is derived from the
time between its first and last token, never from per-token records.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Instance:
    id: str
    node: str
    gpus: int
    alloc_s: float
    kv_cap: int
    state: str = "loading"  # loading | live | serving | draining | released
    accept_from_s: float = float("inf")  # when it may take requests (live/pipeline before ready)
    ready_s: float = float("inf")  # all blocks resident
    block_times: list[float] = field(default_factory=list)  # sorted absolute arrival times
    slow: float = 1.0  # iteration-time factor while serving through a pipeline
    partner: Instance | None = None  # live: the overloaded source running the unloaded layers
    live_share: float = 0.0  # live target: share of layer work it executes itself (ZigZag)
    debt_s: float = 0.0  # live-source: extra time owed for a partner's layers
    waiting: deque[int] = field(default_factory=deque)
    running: list[tuple[int, int]] = field(default_factory=list)  # (finish step, request)
    n_running: int = 0
    kv_reserved: int = 0
    kv_running: int = 0
    step: int = 0
    busy: bool = False
    batch: list[int] = field(default_factory=list)  # the prefill batch in flight ([] for decode)
    released_s: float | None = None
    role: str = "colocated"  # colocated | prefill | decode

    @property
    def accepting(self) -> bool:
        return self.state in ("live", "serving")

    @property
    def load(self) -> int:
        return len(self.waiting) + self.n_running

    @property
    def idle(self) -> bool:
        return not self.busy and not self.waiting and self.n_running == 0

    def loaded_fraction(self, now: float) -> float:
        """Share of blocks resident at `now` (reported; live execution uses the ZigZag share)."""
        if not self.block_times:
            return 1.0
        return bisect_right(self.block_times, now) / len(self.block_times)

    def next_iteration(self, now: float, inp: list[int], out: list[int], prefill_s: Callable[[int], float],
                       decode_s: Callable[[int, int], float], max_tokens: int, max_batch: int) -> float | None:
        """Pick the next iteration; return its duration (None when there is nothing to run)."""
        batch: list[int] = []
        tokens = 0
        while self.waiting and self.n_running + len(batch) < max_batch and self.role != "decode":
            r = self.waiting[0]
            need = min(inp[r] + out[r], self.kv_cap)
            if batch and (tokens + inp[r] > max_tokens):
                break
            if self.kv_reserved + need > self.kv_cap:
                break  # KV full: decode running requests first, they free memory
            self.waiting.popleft()
            self.kv_reserved += need
            batch.append(r)
            tokens += inp[r]
        if batch:
            dur = prefill_s(tokens)
        elif self.n_running:
            dur = decode_s(self.n_running, self.kv_running)
        else:
            return None
        self.batch = batch
        self.busy = True
        dur = dur * self.slow + self.debt_s
        self.debt_s = 0.0
        return float(dur)

    def add_running(self, r: int, inp: int, out: int) -> None:
        heapq.heappush(self.running, (self.step + out - 1, r))
        self.n_running += 1
        self.kv_running += inp + 1

    def decode_done(self) -> list[int]:
        """Advance one decode step; return the requests that produced their last token."""
        self.step += 1
        self.kv_running += self.n_running
        done = []
        while self.running and self.running[0][0] <= self.step:
            done.append(heapq.heappop(self.running)[1])
        self.n_running -= len(done)
        return done
