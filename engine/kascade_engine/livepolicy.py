"""ZigZagPolicy: which of a loading engine's requests run how many layers here before the pair finishes
them, taken from the planner's ZigZag schedule (kascade_planner.zigzag: the same code the planner and
the simulator run, no second implementation).

Data flow: `PairSetting` (layers, load ratio = loading one layer / computing one layer, batches) ->
`ilp_free(s).target_layers` (ZigZag without a solver) or `ilp_config(s)` (the pipeline-configuration
ILP, when the operator provides it) -> prefix targets T_i -> the i-th request this engine admits while
loading (with `batch_tokens`: the i-th batch, requests grouped FCFS into batches of that many prompt tokens,
the schedule's unit being one layer of one full batch) waits until T_i layers are resident, then runs layers 0..T_i-1 here and the rest on the pair
(pairclient.PairClient). T_i = 0: the pair takes it at once (the source is idle enough); a larger T_i
keeps the request here until more layers land. Requests beyond the schedule's batches take whatever is
resident (best effort).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kascade_planner.zigzag import PairSetting, ilp_config, ilp_free


@dataclass
class ZigZagPolicy:
    setting: PairSetting
    ilp: bool = False
    batch_tokens: int | None = None  # prompt tokens of one scheduled batch (None: each request is one)
    targets: tuple[int, ...] = field(init=False)
    admitted: int = 0  # batches opened so far
    _fill: int = 0  # prompt tokens in the open batch

    def __post_init__(self) -> None:
        s = self.setting
        self.targets = ilp_config(s) if self.ilp else ilp_free(s).target_layers

    def next_target(self, resident: int, tokens: int = 1) -> int:
        """The split of the next admitted request (`tokens` prompt tokens): its batch's scheduled prefix, or
        the resident one past the schedule's end."""
        if self.batch_tokens is None or self.admitted == 0 or self._fill + tokens > self.batch_tokens:
            self.admitted, self._fill = self.admitted + 1, 0  # a new batch
        self._fill += tokens
        i = self.admitted - 1
        return min(self.targets[i], self.setting.layers) if i < len(self.targets) else resident


async def hold_until(resident: Callable[[], int], k: int, poll: float = 0.002, limit_s: float = 30.0) -> bool:
    """Wait until `k` layers are resident (blocks land from the loader task on the same loop); False when
    they did not within `limit_s` (a stalled load must not hold a request forever)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while resident() < k:
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True
