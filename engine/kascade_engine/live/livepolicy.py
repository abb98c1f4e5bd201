"""ZigZagPolicy: which of a loading engine's requests run how many layers here before the pair finishes
them, taken from the planner's ZigZag schedule (kascade_planner.zigzag: the same code the planner and
the simulator run, no second implementation).

Re-planned at every admission from the queue as it is, not once for a queue assumed at t = 0: the
schedule's unit is one layer of one full batch, and a request arriving to an idle engine is batch 0 of
a one-batch plan, whatever how many came before it. (A plan made once at pair time, the i-th admitted
batch getting that plan's T_i, held a lone request for layers the plan had reserved for a burst that
never queued: the requests of the bench trace arrive spread out, issue 17.)

Data flow per admission: the prompt tokens of this engine's requests admitted and not yet started
(held for their prefix or waiting in the scheduler; FCFS ahead of this one) -> this request's batch
index i (batches of `batch_tokens` prompt tokens; one request per batch without it) -> `PairSetting`
(layers, load ratio = loading one layer / computing one layer, i + 1 batches, `elapsed` = the resident
layers' share of the load: the plan starts now, mid-load) -> `ilp_free(s).target_layers[i]` (ZigZag
without a solver) or `ilp_config(s)[i]` (the pipeline-configuration ILP, when the operator provides it)
-> T: the request waits until T layers are resident, then runs layers 0..T-1 here and the rest on the
pair (pairclient.PairClient). T = 0: the pair takes it at once. A request beyond the setting's
`batches` (the planning horizon) takes whatever is resident (best effort).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kascade_planner.zigzag import PairSetting, ilp_config, ilp_free


@dataclass
class ZigZagPolicy:
    setting: PairSetting  # the operator's: layers, load ratio, migrate; `batches` caps the planning horizon
    ilp: bool = False
    batch_tokens: int | None = None  # prompt tokens of one scheduled batch (None: each request is one)
    plans: int = 0  # metric: schedules computed (one per admission with a new queue state)
    _cache: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[int, ...]:
        """The plan for `setting.batches` batches all queued when the load began (what a t = 0 plan gives)."""
        return self._plan(self.setting.batches, 0)

    def _plan(self, batches: int, resident: int) -> tuple[int, ...]:
        key = (batches, resident)
        if key not in self._cache:
            s = replace(self.setting, batches=batches, elapsed=resident * self.setting.load_ratio)
            self._cache[key] = ilp_config(s) if self.ilp else ilp_free(s).target_layers
            self.plans += 1
        return self._cache[key]

    def warm(self) -> None:
        """Plan every queue state ahead (1..batches queued, 0..layers resident): admissions then look up."""
        for n in range(1, self.setting.batches + 1):
            for r in range(self.setting.layers + 1):
                self._plan(n, r)

    def batch_index(self, tokens: int, queued_tokens: int, queued_requests: int) -> int:
        """The batch a request of `tokens` prompt tokens joins behind what is queued (FCFS batches)."""
        if self.batch_tokens is None:
            return queued_requests
        return max(0, -(-(queued_tokens + tokens) // self.batch_tokens) - 1)

    def next_target(self, resident: int, tokens: int = 1, queued_tokens: int = 0, queued_requests: int = 0) -> int:
        """The split of a request admitted now: its batch's prefix in the ZigZag schedule of the queue as it
        is (`queued_*`: this engine's requests admitted and not yet started, ahead of this one), with
        `resident` layers already here; the resident prefix past the planning horizon."""
        i = self.batch_index(tokens, queued_tokens, queued_requests)
        if i >= self.setting.batches:
            return resident
        return min(self._plan(i + 1, resident)[i], self.setting.layers)


async def hold_until(resident: Callable[[], int], k: int, poll: float = 0.002, limit_s: float = 30.0) -> bool:
    """Wait until `k` layers are resident (blocks land from the loader task on the same loop); False when
    they did not within `limit_s` (a stalled load must not hold a request forever)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while resident() < k:
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True
