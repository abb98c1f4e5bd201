"""StepRecorder: what one engine step's timing teaches the engine about itself, kept out of the step's logic.

Data flow: `Engine.step` -> `begin(work, requests, hooks)` before the forward (what this step runs and the
scheduler's state that qualifies its timing: prompt chunks, whether prompts waited, whether the step was
saturated, whether its budget could cut chunks yet, the room a converted decoder had) -> the forward, timed ->
`end(note, work, seconds)`: the velocity meter (prefill/decode tokens/s, velocity.py), the step-cost fit
(stepcost.py, only for steps that ran this engine's own work alone) and the budget's record (`last_step`,
`prefill_step_max` under the chunk budget in force now), which metrics.py exports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kascade_engine.batch.scheduler import Scheduler, Work
from kascade_engine.batch.stepcost import StepCost, StepShape
from kascade_engine.batch.velocity import VelocityMeter


class _Prompted(Protocol):
    @property
    def prompt(self) -> list[int]: ...  # an engine Request's prompt


class _Pending(Protocol):
    def pending(self) -> bool: ...  # the engine's step hook: a live pair's rows hosted or out on the peer


@dataclass(frozen=True)
class StepNote:
    """A step's facts read before its forward (the forward and the next schedule change them)."""

    prefill: list[tuple[int, int]]  # (chunk tokens, prompt length) of each prompt chunk
    pending: bool  # prompts waited (this step's own prompt chunks count)
    saturated: bool  # its prompt tokens were limited by the token cap or budget while more waited
    budgeted: bool  # no step budget, or the step-cost fit can cut chunks to it already
    room: int | None  # a converted decoder with no prompt waiting: the tokens its budgets would give one
    own: bool  # the step ran only this engine's work (no live pair's rows hosted or out on the peer)


class StepRecorder:
    def __init__(self, scheduler: Scheduler, meter: VelocityMeter, cost: StepCost) -> None:
        self.scheduler = scheduler  # its `cost` is read each time: tests put a stand-in there
        self.meter = meter
        self.cost = cost
        # the last step as (prompt tokens prefilled, decode rows, seconds), and the most prompt tokens one step
        # prefilled under the chunk budget in force now (`budget_of_max`; a new budget starts it again): what a
        # converted decoder's /metrics shows to prove its budget held (metrics.py)
        self.last_step: tuple[int, int, float] | None = None
        self.prefill_step_max = 0
        self.budget_of_max: int | None = None

    def begin(self, work: list[Work], requests: Mapping[str, _Prompted], hooks: _Pending | None,
              rs: Sequence[_Prompted] | None = None) -> StepNote:
        """`rs`: each chunk's request, when the caller has them (saves a lookup per chunk)."""
        sched = self.scheduler
        if rs is None:
            rs = [requests[w.id] for w in work]
        prefill = [(w.n, p) for w, r in zip(work, rs, strict=True) if w.start < (p := len(r.prompt))]
        pending = sched.prompts_pending()  # before `advance`: this step's own prompt chunks count
        # its prompt tokens were limited by the step's token cap or budget while more waited: only such a step's
        # tokens/s is the engine's prefill capacity (velocity.py; read now: the next schedule overwrites it)
        saturated = sched.last_saturated
        # the prefill rate is what the budgets give a prompt: a step whose chunk the step budget could not cut yet
        # (no prompt token timed) ran under the token cap alone, and counting it reported a rate the budget never
        # gives (bench/pd.py 2026-11-27-d run 7: 306.7 tok/s on D's first prompt, ~0 a second later)
        budgeted = sched.last_budget_s is None or (sched.cost is not None and sched.cost.token_s is not None)
        # a converted decoder with no prompt waiting: the tokens its budgets would give one beside these decodes
        room = None if pending else sched.known_room()
        # a step that also runs a live pair's rows (hosted, or out on the peer) times more than this engine's work
        own = hooks is None or not hooks.pending()
        return StepNote(prefill, pending, saturated, budgeted, room, own)

    def end(self, note: StepNote, work: list[Work], secs: float) -> None:
        self.meter.observe(note.prefill, len(work) - len(note.prefill), secs, saturated=note.saturated)
        tokens = sum(n for n, _ in note.prefill)
        if note.own:
            starts = [w.start for w in work if w.n == 1]
            if len(starts) == len(work) and starts:  # decodes only: StepShape.of's answer in one pass
                shape = StepShape(len(starts), max(starts) + 1)
            else:
                shape = StepShape.of([(w.start, w.n) for w in work])
            self.cost.observe(shape, secs)
            if note.pending and note.budgeted:
                self.meter.observe_rate(tokens, secs)
            elif note.room is not None:  # what a prompt would have got, the chunk's predicted time added to the step's
                self.meter.observe_rate(note.room, secs + note.room * (self.cost.token_s or 0.0))
        self.last_step = (tokens, len(work) - len(note.prefill), secs)
        if self.scheduler.last_cap != self.budget_of_max:
            self.budget_of_max, self.prefill_step_max = self.scheduler.last_cap, 0
        self.prefill_step_max = max(self.prefill_step_max, tokens)
