"""Hand-back: a converted decoder gives a prompt it has no room to prefill to a prefill engine, instead of
holding it until its batch drains.

Why: a converted decoder's step budget (scheduler.py, stepcost.py) gives a prompt chunk only the time its
decodes leave; beside a big batch that is 0 tokens, step after step. The router sends it a prompt only while
its last reported room allows (PREFILL_ROOM_HEADER), but that report is as old as the decoder's last answer,
and a batch can grow after a prompt arrived: such a prompt waited seconds (bench/pd.py: convertible TTFT p99
7.4 s against 3.0 s disaggregated, docs/worklog/2026-11-27/h18.md).

Data flow: the router names a prefill engine's data port on a prompt it lets the converted decoder prefill
itself (PREFILL_FALLBACK_HEADER) -> `Serving.submit` prefills it here and `HandBack.watch`es it -> every
`after_s` (the conversion's hand-back bound) a check runs IN THE STEP THREAD, between steps: if the prompt
is still held (waiting, or running in prefill) with no token out and no more prompt tokens computed than at
the last check, it leaves this engine's scheduler (its pages freed, its partial prefill dropped) and goes to
`RemotePrefill.start` on that peer, exactly as a request the router had sent with `X-Kascade-Prefill`: the
prefill engine computes the whole prompt, its KV and first token come back, and the sequence joins this
batch as a decode. Nothing reached the client before (no token was out), and every token after comes from
the same remote-prefill path whose greedy output equals the colocated engine's; if the peer fails, the
prompt is prefilled here after all (RemotePrefill's local fallback), not lost. A prompt that progresses is
checked again after another bound; one that got its first token is never touched again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kascade_engine.engine import Event
from kascade_engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kascade_engine.engine import Engine
    from kascade_engine.instance import EngineInstance

log = logging.getLogger(__name__)
# a converted decoder's hand-back bound when its conversion names none: a fraction of a typical TTFT objective
# (bench/pd.py calibrates ~1 s), long enough for a decode or two to end and free room, short beside the seconds a
# prompt waited for a batch to drain
DEFAULT_HAND_BACK_S = 0.25


class HandBack:
    """The converted decoder's watch over prompts it prefills itself with a fallback prefill engine."""

    def __init__(self, inst: EngineInstance) -> None:
        self.inst = inst
        self.after_s: float | None = None  # the conversion's bound; None: not converted, nothing is watched
        self.handed = 0  # prompts handed to a prefill engine (kascade_pd_handbacks_total)

    def watch(self, rid: str, prompt: list[int], params: SamplingParams, peer: str) -> None:
        """Called on the event loop right after `rid` was submitted here: check it every `after_s`."""
        if self.after_s is None:
            return
        self._arm(rid, prompt, params, peer, self.after_s, 0)

    def _arm(self, rid: str, prompt: list[int], params: SamplingParams, peer: str, after_s: float,
             seen: int) -> None:
        loop = asyncio.get_running_loop()

        def due() -> None:
            if rid not in self.inst.serving.queues:  # finished, failed or the client went away
                return
            self.inst.engine.call_in_step(lambda eng: self._check(eng, loop, rid, prompt, params, peer, after_s, seen))
            self.inst.serving.wake.set()

        loop.call_later(after_s, due)

    def _check(self, eng: Engine, loop: asyncio.AbstractEventLoop, rid: str, prompt: list[int],
               params: SamplingParams, peer: str, after_s: float, seen: int) -> list[Event]:
        """In the step thread, between steps (nothing of `rid` is in flight): hand it back, or check again later."""
        r = eng.requests.get(rid)
        sched = eng.scheduler
        # tuple(): copied in one C call; a generator over the deque itself could meet the event loop's
        # Serving.submit appending meanwhile ("deque mutated during iteration", failing the step)
        s = sched.running.get(rid) or next((x for x in tuple(sched.waiting) if x.id == rid), None)
        if r is None or r.out or s is None:
            return []  # gone, or a token is out (the client may have it): it stays here
        if s.computed > seen:  # it progresses: look again after another bound
            loop.call_soon_threadsafe(self._arm, rid, prompt, params, peer, after_s, s.computed)
            return []
        sched.finish(rid)  # out of this batch: its pages go back, its partial prefill (if any) is dropped
        del eng.requests[rid]
        self.handed += 1
        self.inst.pd_metrics.handbacks.inc()
        log.info("request %s: no prefill progress for %.3f s (%d of %d prompt tokens computed); handed to %s",
                 rid, after_s, s.computed, len(prompt), peer)
        loop.call_soon_threadsafe(self._send, rid, prompt, params, peer)
        return []

    def _send(self, rid: str, prompt: list[int], params: SamplingParams, peer: str) -> None:
        """On the event loop: the prompt is prefilled on `peer`, as if the router had named it; here if that fails."""
        inst = self.inst
        if rid not in inst.serving.queues:
            return  # the client went away meanwhile: nothing to serve

        def local() -> None:
            inst.engine.submit(prompt, params, rid)
            inst.serving.wake.set()

        inst.remote_prefill.start(rid, prompt, params, peer, local)
