"""Hand-back: a converted decoder gives a prompt it has no room to prefill to a prefill engine, instead of
holding it until its batch drains.

Why: a converted decoder's step budget (scheduler.py, stepcost.py) gives a prompt chunk only the time its
decodes leave; beside a big batch that is 0 tokens, step after step. The router sends it a prompt only while
its last reported room allows (PREFILL_ROOM_HEADER), but that report is as old as the decoder's last answer,
and a batch can grow after a prompt arrived: such a prompt waited seconds (bench/pd.py: convertible TTFT p99
7.4 s against 3.0 s disaggregated; ADR 0010).

Data flow: the router names a prefill engine's data port on a prompt it lets the converted decoder prefill
itself (PREFILL_FALLBACK_HEADER) -> `Serving.submit` asks `HandBack.on_arrival` first: the same rule with this
engine's measured prefill rate in place of progress (`kascade_planner.conversion.arrival_verdict`) sends the prompt
to that peer at once when the rate is 0, slower than the remote path, or not measured yet (just converted: its
warm-up, probe.py, has not measured it; the router's view of it may be older still) -> otherwise it prefills it
here and `HandBack.watch`es it -> every
`after_s` (the conversion's hand-back bound) a check runs IN THE STEP THREAD, between steps: if the prompt
is still held (waiting, or running in prefill) with no token out and no more prompt tokens computed than at
the last check, it leaves this engine's scheduler (its pages freed, its partial prefill dropped) and goes to
`RemotePrefill.start` on that peer, exactly as a request the router had sent with `X-Kascade-Prefill`: the
prefill engine computes the whole prompt, its KV and first token come back, and the sequence joins this
batch as a decode. Nothing reached the client before (no token was out), and every token after comes from
the same remote-prefill path whose greedy output equals the colocated engine's; if the peer fails, the
prompt is prefilled here after all (RemotePrefill's local fallback), not lost. One that got its first token
is never touched again. The answer names who prefills the prompt (HANDED_BACK_HEADER), settled once the
hand-back's prefill op went out to the peer (a dead peer fails before: the prompt is prefilled here and the answer
names none), else at its first token (Serving.decisions): the router counts and times the prompt there from then.

The rule (`kascade_planner.conversion.hand_back_verdict`, pure, the simulator's too), at each check: no progress over
the bound -> hand back; progress -> this engine's
predicted finish of the prompt's prefill (the tokens left / the rate it got over the last bound, i.e. what its
step budget gives it now) against the remote path's (`RemotePrefill.took`: what a prefill on that peer took
lately, queue included, for the whole prompt, since the partial prefill is dropped): hand back when the remote
path finishes sooner (`RemotePrefill.expected_s`, `conversion.remote_prefill_s`: the oldest wait of this engine's
prompts in flight at that peer plus their prompt tokens and this one's at the peer's reported pace, never under
that average: a prompt sent now waits behind the ones queued before it); else check again after another bound. Without
a measured remote path, progress keeps
the prompt here. The handed-back prompt carries the time it waited here (kv_wire.PrefillOp.waited_s): the
prefill engine queues it by its arrival, not behind prompts that reached the router after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from kascade_engine.batch.engine import Event
from kascade_engine.batch.sampling import SamplingParams
from kascade_planner.conversion import arrival_verdict, hand_back_verdict

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.pd.metrics import PDMetrics

log = logging.getLogger(__name__)
# a converted decoder's hand-back bound when its conversion names none: a fraction of a typical TTFT objective
# (bench/pd.py calibrates ~1 s), long enough for a decode or two to end and free room, short beside the seconds a
# prompt waited for a batch to drain
DEFAULT_HAND_BACK_S = 0.25
SERVED = "the engine it prefills for"  # a served prompt (prefill_server.py) goes back to the engine that sent it


class _Streams(Protocol):
    @property
    def queues(self) -> Mapping[str, object]: ...  # the requests still waited on

    @property
    def wake(self) -> asyncio.Event: ...


class _RemotePrefill(Protocol):
    def start(self, rid: str, prompt: list[int], params: SamplingParams, peer: str,
              local: Callable[[], None], arrived: float | None = None, fallback: str | None = None,
              settles: bool = False) -> None: ...

    def expected_s(self, peer: str, prompt_tokens: int = 0) -> float | None: ...


class HandBackHost(Protocol):
    """What the hand-back reads of its engine instance (EngineInstance is one): read each time, since bind may
    rebuild the engine for another dtype."""

    @property
    def engine(self) -> Engine: ...

    @property
    def serving(self) -> _Streams: ...

    @property
    def remote_prefill(self) -> _RemotePrefill: ...

    @property
    def pd_metrics(self) -> PDMetrics: ...


class HandBack:
    """The converted decoder's watch over prompts it prefills itself with a fallback prefill engine."""

    def __init__(self, inst: HandBackHost) -> None:
        self.inst = inst
        self.after_s: float | None = None  # the conversion's bound; None: not converted, nothing is watched
        self.handed = 0  # prompts handed to a prefill engine (kascade_pd_handbacks_total)
        self.at_arrival = 0  # of those, handed as they arrived (`on_arrival`), without waiting here first

    def on_arrival(self, rid: str, prompt: list[int], params: SamplingParams, peer: str,
                   local: Callable[[], None]) -> bool:
        """Called on the event loop as `rid` arrives, before it is queued here: True when it goes to `peer` at once
        (`refuses`), prefilled there by the same remote-prefill path as a hand-back (`local()` queues it here if
        that fails). False: not converted, or it stays; the caller queues it and `watch`es it."""
        why = self.refuses(len(prompt), peer)
        if why is None:
            return False
        self.count(rid, why, peer, "on arrival")
        self.inst.remote_prefill.start(rid, prompt, params, peer, local, settles=True)
        return True

    def refuses(self, prompt_len: int, peer: str | None) -> str | None:
        """Why this converted decoder should not start a prompt of `prompt_len` tokens it was just sent (None: it
        starts it; always None when not converted): `arrival_verdict` on its measured prefill rate and what a
        prefill on `peer` (the prefill engine it would go to; None: unknown) takes now."""
        if self.after_s is None:
            return None
        eng = self.inst.engine
        remote = None if peer is None else self.inst.remote_prefill.expected_s(peer, prompt_len)
        return arrival_verdict(prompt_len, eng.meter.prefill_rate(), remote, eng.scheduler.decodes())

    def watch(self, rid: str, prompt: list[int], params: SamplingParams, peer: str) -> bool:
        """Called on the event loop right after `rid` was submitted here: check it every `after_s`; handing it back
        prefills it on `peer`. False when nothing is watched (not converted)."""
        if self.after_s is None:
            return False
        self._arm(rid, len(prompt), peer, peer, self.after_s, 0, time.monotonic(),
                  lambda arrived, why: self._send(rid, prompt, params, peer, arrived))
        return True

    def watch_served(self, rid: str, prompt_len: int, fallback: str | None,
                     give_back: Callable[[str], None]) -> bool:
        """A prompt this converted decoder prefills for another decode engine (prefill_server.py, `rid` its request
        here): the same checks, by the same rule; handing it back is `give_back(why)` (on the event loop: the prefill
        server tells that engine, which prefills it on its fallback prefill engine, or itself). `fallback`: the
        prefill engine that engine would use (its prefill op names it), for the remote path's time; None: progress
        keeps the prompt here. False when nothing is watched (not converted)."""
        if self.after_s is None:
            return False
        self._arm(rid, prompt_len, fallback, SERVED, self.after_s, 0, time.monotonic(),
                  lambda arrived, why: give_back(why))
        return True

    def count(self, rid: str, why: str, to: str, when: str) -> None:
        """One prompt handed back (`when`: on arrival, or after its bound), logged with why and to whom."""
        self.handed += 1
        self.at_arrival += when == "on arrival"
        self.inst.pd_metrics.handbacks.inc()
        log.info("request %s: %s; handed to %s %s", rid, why, to, when)

    def _arm(self, rid: str, prompt_len: int, peer: str | None, to: str, after_s: float, seen: int, seen_at: float,
             act: Callable[[float, str], None]) -> None:
        loop = asyncio.get_running_loop()

        def due() -> None:
            if rid not in self.inst.serving.queues:  # finished, failed or the client went away
                return
            self.inst.engine.call_in_step(
                lambda eng: self._check(eng, loop, rid, prompt_len, peer, to, after_s, seen, seen_at, act))
            self.inst.serving.wake.set()

        loop.call_later(after_s, due)

    def _check(self, eng: Engine, loop: asyncio.AbstractEventLoop, rid: str, prompt_len: int, peer: str | None,
               to: str, after_s: float, seen: int, seen_at: float, act: Callable[[float, str], None]) -> list[Event]:
        """In the step thread, between steps (nothing of `rid` is in flight): hand it back (`act(arrived, why)` on the
        loop, once it left this engine), or check again later."""
        r = eng.requests.get(rid)
        sched = eng.scheduler
        # a snapshot (Scheduler.queued): the event loop's Serving.submit may add to the queue meanwhile
        s = sched.running.get(rid) or next((x for x in sched.queued() if x.id == rid), None)
        if r is None or r.out or s is None:
            return []  # gone, or a token is out (the client may have it): it stays here
        now = time.monotonic()
        why = hand_back_verdict(prompt_len - s.computed, s.computed - seen, now - seen_at,
                                None if peer is None else self.inst.remote_prefill.expected_s(peer, prompt_len))
        if why is None:  # it progresses fast enough: look again after another bound
            loop.call_soon_threadsafe(self._arm, rid, prompt_len, peer, to, after_s, s.computed, now, act)
            return []
        arrived = s.arrived
        sched.finish(rid)  # out of this batch: its pages go back, its partial prefill (if any) is dropped
        del eng.requests[rid]
        why = f"{why} ({s.computed} of {prompt_len} prompt tokens computed, waited {now - arrived:.3f} s)"
        self.count(rid, why, to, "after its bound")
        loop.call_soon_threadsafe(act, arrived, why)
        return []

    def _send(self, rid: str, prompt: list[int], params: SamplingParams, peer: str, arrived: float) -> None:
        """On the event loop: the prompt is prefilled on `peer`, as if the router had named it; here if that fails."""
        inst = self.inst
        if rid not in inst.serving.queues:
            return  # the client went away meanwhile: nothing to serve

        def local() -> None:
            inst.engine.submit(prompt, params, rid, arrived=arrived)
            inst.serving.wake.set()

        inst.remote_prefill.start(rid, prompt, params, peer, local, arrived, settles=True)
