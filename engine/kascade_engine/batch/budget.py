"""PrefillBudget: how many prompt tokens a convertible decoder lets into one step, kept out of the scheduler's
batching. A converted decoder caps prompt tokens per step (`prefill_chunk_tokens`) and, with a step budget
(`step_budget_s`), cuts each prompt chunk to the time its measured step cost (stepcost.py) leaves after the
step's decodes (the TBT objective). Pure python, no torch.

Data flow: `Scheduler.schedule` -> `begin(cap, budget_s, ..., cost)`: the budget in force for this step (the limits,
or the one held for prompts accepted under it) -> a `StepBudget` the schedule spends: `timed(start, n)` cuts a
prompt chunk to the time left, `prefill_left` and `shape` follow what the step runs -> `timed_out` and
`prefill_left` tell the scheduler whether prefill was saturated. `last_cap`, `last_budget_s` and `cut_tokens`
are read by the metrics and the step recorder.
"""

from __future__ import annotations

from collections.abc import Callable

from kascade_engine.batch.stepcost import StepCost, StepShape


class PrefillBudget:
    def __init__(self) -> None:
        # the prefill chunk budget the last `schedule` applied (read once per step: /convert may change the
        # limit from the event loop meanwhile), so a step's prompt tokens are judged against its own budget
        self.last_cap: int | None = None
        # a converted decoder taken back (/convert null) still holds the prompts it accepted while converted:
        # they finish prefilling under the budget they were accepted with (`held_cap`) instead of in one
        # uncapped step that would stall every decode in the batch; the cap goes once no prompt is in prefill
        self.held_cap: int | None = None
        self.held_budget_s: float | None = None  # the time budget held with it
        # the step budget the last `schedule` applied (None: none), and the prompt tokens the time budget has held
        # back from steps so far (each would have run under the token cap alone)
        self.last_budget_s: float | None = None
        self.cut_tokens = 0

    def begin(self, cap: int | None, budget_s: float | None, tokens: int,
              prefilling: Callable[[], bool], cost: StepCost | None) -> StepBudget:
        """This step's budget from the limits now (`cap`, `budget_s`; `tokens`: the step's token budget);
        `prefilling()`: whether a prompt is still queued or in prefill (asked only while a budget is held);
        `cost`: the engine's step-time model (stepcost.py; None or not yet measured: the token cap alone)."""
        if cap is not None:
            self.held_cap, self.held_budget_s = cap, budget_s
        elif self.held_cap is not None:
            if prefilling():
                cap, budget_s = self.held_cap, self.held_budget_s
            else:
                self.held_cap = self.held_budget_s = None
        self.last_cap = cap
        self.last_budget_s = budget_s = budget_s if cap is not None else None
        return StepBudget(self, budget_s, cap or tokens, cost)  # a converted decoder caps prefill per step


class StepBudget:
    """One schedule's prefill room: prompt tokens left under the cap, and what the step runs so far (for the
    time budget)."""

    def __init__(self, owner: PrefillBudget, budget_s: float | None, prefill_left: int, cost: StepCost | None) -> None:
        self.owner, self.cost = owner, cost
        self.budget_s = budget_s
        self.prefill_left = prefill_left
        self.shape = StepShape()  # what the step runs so far (for the time budget)
        self.timed_out = False  # the time budget cut a prompt chunk (or left no time for one)

    def timed(self, start: int, n: int) -> int:
        """Of an `n`-token prompt chunk from `start`, what fits the step's time budget (all of it without
        one, without a measured cost, or in a step with no decode to protect)."""
        cost = self.cost
        if self.budget_s is None or cost is None or not self.shape.decodes:
            return n
        fit = cost.chunk_fits(self.budget_s, self.shape, start, n)
        if fit is None:
            return n
        self.owner.cut_tokens += n - fit
        self.timed_out = self.timed_out or fit < n
        return fit
