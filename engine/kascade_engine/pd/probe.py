"""Prefill probe: a converted decoder measures its prefill rate as it is converted, with a synthetic prompt, before
any real prompt depends on it.

Why: the router weighs a converted decoder by its measured prefill rate (kascade_router.balancer) and the decoder
judges a prompt it was sent by it (`kascade_planner.conversion.arrival_verdict`). In disaggregated serving a decoder
has never prefilled: its step cost has no prompt-token cost (stepcost.StepCost.token_s), so it can neither cut a
chunk to its step budget nor predict the room a prompt would get (Scheduler.known_room), and its rate stays
unmeasured until a real prompt has paid for measuring it. The burst's first prompts did (bench/pd.py:
1-2 per run, taken at the constant share 49-298 ms after the conversion, held for the hand-back bound,
handed back). A production engine warms up before it takes traffic it cannot size (a GPU engine's profiling
forward at start); this is that warm-up for the conversion's budgets, run beside the decodes they are about.

Data flow: `EngineInstance.convert` with new budgets -> `start`: a synthetic prompt (token ids without meaning; its
KV is dropped, it never samples a token) queued in the step thread -> the scheduler prefills it under the new token
cap and, once a prompt token is timed, the step budget, beside the decodes -> `Engine.step` times those steps: the
step cost learns a prompt token's cost after `stepcost.TIMED_STEPS` steps; with chunks then cut to the budget, the
meter measures the prefill rate over `prefillrate.RATE_STEPS` steps (steps whose chunk the budget could not cut yet do
not count) -> `Serving`'s loop calls `tick` after every step: once the rate is measured, or `PROBE_MAX_S` passed
(pages short, say: the rate then stays unmeasured and the decoder keeps handing prompts back on arrival), the probe
leaves the scheduler in the step thread, its pages freed. From then on the rate follows the batch between prompts
(Scheduler.known_room) and is sent on answers and /readyz (PREFILL_RATE_HEADER). Taking the conversion back
(or new budgets) ends a probe still running.

Cost: a few steps with the probe's chunk beside the decodes, the first `TIMED_STEPS` of them under the token cap
alone (nothing can cut them yet); the conversion's chunk budget is sized to half a TBT objective.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Protocol

from kascade_engine.batch.engine import Event
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.stepcost import TIMED_STEPS
from kascade_planner.prefillrate import RATE_STEPS

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel

log = logging.getLogger(__name__)
PROBE_MAX_S = 3.0  # a probe not done by then is ended: a decoder whose pages are short must not hold it longer


class _Wake(Protocol):
    @property
    def wake(self) -> asyncio.Event: ...


class ProbeHost(Protocol):
    """What the probe reads of its engine instance (EngineInstance is one), each time: bind may rebuild the engine."""

    @property
    def engine(self) -> Engine: ...

    @property
    def model(self) -> LlamaModel: ...

    @property
    def serving(self) -> _Wake: ...

    @property
    def context_len(self) -> int: ...

    @property
    def instance_id(self) -> str: ...


class PrefillProbe:
    """The converted decoder's warm-up prompt: at most one at a time."""

    def __init__(self, inst: ProbeHost) -> None:
        self.inst = inst
        self.rid: str | None = None  # the probe in the scheduler now (None: none)
        self.started = 0.0
        self.ended: list[tuple[str, float]] = []  # (how, seconds) of probes that ended: tests, logs

    @staticmethod
    def length(cap: int, limit: int) -> int:
        """Prompt tokens of a probe under a `cap`-token chunk budget: enough that it is still prefilling when its
        rate is measured (TIMED_STEPS steps of up to `cap` tokens, then RATE_STEPS more, each up to `cap`), so it
        never reaches its last token and samples; no longer than `limit` (the context)."""
        if cap < 1 or limit < 2:
            raise ValueError(f"probe: cap must be >= 1 and limit >= 2, got {cap}, {limit}")
        return min((TIMED_STEPS + RATE_STEPS + 1) * cap + 1, limit - 1)

    def start(self) -> None:
        """Queue a probe under the budgets in force now (called on the event loop by /convert); ends one running."""
        cap = self.inst.engine.limits.prefill_chunk_tokens
        self.stop()
        if cap is None:
            return
        sched = self.inst.engine.scheduler
        n = self.length(cap, min(self.inst.context_len, sched.pool.capacity_tokens))
        vocab = self.inst.model.shape.vocab
        prompt = [1 + i % (vocab - 1) for i in range(n)]
        rid = self.rid = f"probe-{uuid.uuid4().hex[:12]}"
        self.started = time.monotonic()

        def queue(eng: Engine) -> list[Event]:
            if self.rid == rid:  # not ended meanwhile
                eng.submit(prompt, SamplingParams(max_tokens=1), rid)
            return []

        self.inst.engine.call_in_step(queue)
        self.inst.serving.wake.set()
        log.info("%s: prefill probe %s (%d prompt tokens) under a %d-token cap", self.inst.instance_id, rid, n, cap)

    def tick(self) -> None:
        """After a step (on the event loop): end the probe once the rate is measured or it ran PROBE_MAX_S."""
        if self.rid is None:
            return
        rate = self.inst.engine.meter.prefill_rate()
        took = time.monotonic() - self.started
        if rate is not None:
            log.info("%s: prefill probe done in %.3f s: prefill rate %.1f tok/s, a prompt token %.3f ms",
                     self.inst.instance_id, took, rate, 1e3 * (self.inst.engine.cost.token_s or 0.0))
            self._end("measured", took)
        elif took > PROBE_MAX_S:
            log.warning("%s: prefill probe ended unmeasured after %.3f s", self.inst.instance_id, took)
            self._end("timeout", took)

    def stop(self) -> None:
        """End a probe still running (the conversion was taken back or its budgets changed)."""
        if self.rid is not None:
            self._end("stopped", time.monotonic() - self.started)

    def _end(self, how: str, took: float) -> None:
        rid, self.rid = self.rid, None
        assert rid is not None
        self.ended.append((how, took))

        def drop(eng: Engine) -> list[Event]:
            eng.scheduler.finish(rid)  # its pages go back; its partial prefill is dropped
            eng.requests.pop(rid, None)
            return []

        self.inst.engine.call_in_step(drop)
        self.inst.serving.wake.set()
