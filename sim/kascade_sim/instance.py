"""One serving instance inside the simulator: continuous batching over a KV budget.

Data flow: the model's global queue (shared by every instance of one model and role, so backlog goes
to whichever instance frees up first, new and live ones included) -> a prefill iteration (prompt
tokens batched up to a budget, admitted only if their KV fits) -> `running` (a heap keyed by the
decode step at which each finishes) -> decode iterations (one token for every running request).
A live pair (ZigZag) is one loading target and one serving partner: the target runs the layers it
holds and the partner owes the rest (`debt_s`), paid at the start of its next iteration; the target
takes no new batch while its partner still owes for the last one, so the debt stays bounded by one
iteration. All bookkeeping is O(1) or O(log n) per iteration: a request's TBT is derived from the
time between its first and last token, never from per-token records.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kascade_planner.prefillrate import PrefillRate


@dataclass(eq=False)
class Instance:
    id: str
    node: str
    gpus: int
    alloc_s: float
    kv_cap: int
    model: int = 0
    role: str = "colocated"  # colocated | prefill | decode
    state: str = "loading"  # loading | live | serving | draining | released
    accept_from_s: float = float("inf")  # when it may take requests (live/pipeline before ready)
    ready_s: float = float("inf")  # all blocks resident
    block_times: list[float] = field(default_factory=list)  # sorted absolute arrival times
    slow: float = 1.0  # iteration-time factor while serving through a pipeline
    partner: Instance | None = None  # live target: the serving partner running the layers not yet loaded
    live_target: Instance | None = None  # serving partner: its one live target
    live_share: float = 0.0  # live target: share of layer work it executes itself (ZigZag)
    debt_s: float = 0.0  # partner: time owed for its live target's layers
    from_ssd: bool = False  # loading from the local SSD (its host copy is warm only once loaded)
    preempted: bool = False  # draining to free its GPUs for another model: never taken back
    solo: bool = False  # no other target's load passes through this one: its load may be cancelled
    convertible: bool = False  # decoder: converted by the conversion policy (it may take prefill)
    converted: bool = False  # decoder: the iteration in flight (or last) is a prefill batch (convertible)
    chunk_req: int = -1  # converted decoder: the long prompt being prefilled chunk by chunk
    chunk_left: int = 0  # ... and its tokens not yet prefilled
    chunk_seen: int = 0  # ... its tokens prefilled at the last hand-back check
    chunk_seen_at: float = 0.0  # ... and when that check was
    # prefillers and converted decoders: prompt tokens per step-second while prompts waited (serving._measure)
    rate: PrefillRate = field(default_factory=PrefillRate)
    running: list[tuple[int, int]] = field(default_factory=list)  # (finish step, request)
    n_running: int = 0
    kv_reserved: int = 0
    kv_running: int = 0
    kv_peak: int = 0
    incoming: int = 0  # decode: requests whose KV is on its way here (already reserved)
    step: int = 0
    busy: bool = False
    busy_until: float = 0.0  # when the iteration in flight ends (valid while `busy`)
    decoding: bool = False  # the iteration in flight is a decode step
    batch: list[int] = field(default_factory=list)  # the prefill batch in flight ([] otherwise)
    released_s: float | None = None

    @property
    def accepting(self) -> bool:
        return self.state in ("live", "serving")

    @property
    def active(self) -> bool:
        return self.state in ("loading", "live", "serving")

    @property
    def load(self) -> int:
        return len(self.batch) + self.n_running

    @property
    def idle(self) -> bool:
        return not self.busy and self.n_running == 0

    @property
    def cancellable(self) -> bool:
        """Still loading, holding no work, and relaying nothing: releasing it only stops its own load."""
        return (self.state in ("loading", "live") and self.solo and not self.busy and not self.n_running
                and not self.kv_reserved and not self.incoming)

    def loaded_fraction(self, now: float) -> float:
        """Share of blocks resident at `now` (reported; live execution uses the ZigZag share)."""
        if not self.block_times:
            return 1.0
        return bisect_right(self.block_times, now) / len(self.block_times)

    def reserve(self, tokens: int) -> None:
        self.kv_reserved += tokens
        if self.kv_reserved > self.kv_peak:
            self.kv_peak = self.kv_reserved

    def next_iteration(
        self,
        now: float,
        queue: deque[int],
        inp: list[int],
        out: list[int],
        prefill_s: Callable[[int], float],
        decode_s: Callable[[int, int], float],
        max_tokens: int,
        max_batch: int,
        take: bool,
    ) -> float | None:
        """Pick the next iteration (prefill first, from the shared queue when `take`); return its
        duration (None when there is nothing to run, not even owed partner work)."""
        batch: list[int] = []
        tokens = 0
        while take and queue and self.n_running + len(batch) < max_batch:
            r = queue[0]
            need = inp[r] + out[r]
            if batch and tokens + inp[r] > max_tokens:
                break
            if self.kv_reserved + need > self.kv_cap:
                break  # KV full: decode running requests first, they free memory
            queue.popleft()
            self.reserve(need)
            batch.append(r)
            tokens += inp[r]
        self.decoding = False
        if batch:
            dur = prefill_s(tokens)
        elif self.n_running:
            dur = decode_s(self.n_running, self.kv_running)
            self.decoding = True
        elif self.debt_s > 0:
            dur = 0.0
        else:
            return None
        self.batch = batch
        self.busy = True
        if self.slow != 1.0:  # slowed only for the part of the iteration before every block is resident
            dur += (self.slow - 1.0) * min(dur, max(0.0, self.ready_s - now))
        dur += self.debt_s
        self.debt_s = 0.0
        return float(dur)

    def add_running(self, r: int, inp: int, out: int) -> None:
        # A request joining while a decode step is in flight was not in that step: its first decode step is the
        # next one (crediting it with the in-flight step put its TBT below one step's time).
        joins = self.step + (1 if self.busy and self.decoding else 0)
        heapq.heappush(self.running, (joins + out - 1, r))
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
