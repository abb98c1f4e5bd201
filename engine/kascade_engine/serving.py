"""Serving: the request side of an engine instance — submit, stream tokens, abort — and the loop that
drives the batching engine.

Data flow: `submit(prompt, params)` -> `Engine.submit` (every block resident, or live: the same batch,
whose steps run our resident prefix here and finish on the paired peer, see cooperation.py) -> an asyncio queue per
request -> `tokens(rid)` yields `Event`s; leaving the iterator early (client gone) aborts the request,
which frees its KV pages before the next step. The loop runs `Engine.step` in a worker thread whenever
work exists and routes the step's events to the queues.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Protocol

from kascade_engine.batch import timeline
from kascade_engine.batch.engine import Event
from kascade_engine.batch.sampling import SamplingParams
from kascade_planner.engine_api import HandedBack

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.config import EngineConfig
    from kascade_engine.live.liveredirect import Forwarder
    from kascade_engine.live.pairclient import PairClient
    from kascade_engine.metrics import EngineMetrics
    from kascade_engine.pd.handback import HandBack
    from kascade_engine.pd.probe import PrefillProbe
    from kascade_engine.pd.remote_prefill import RemotePrefill

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request refused before it runs (400/503), or failed while running (500)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 that sheds load)


SHED_LOG_EVERY_S = 10.0  # at most one shedding warning per interval (one per request flooded the log)


class ServingHost(Protocol):
    """What the request side reads of its engine instance (EngineInstance is one), each time it needs it: bind may
    rebuild the engine and model for another dtype, and the live pair and forwarders come and go."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def model(self) -> LlamaModel: ...

    @property
    def phase(self) -> enum.Enum: ...

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def pair(self) -> PairClient | None: ...  # while loading with a peer: our rows finish there

    @property
    def forwarders(self) -> Mapping[str, Forwarder]: ...  # peers our queued requests went to (liveredirect.py)

    @property
    def remote_prefill(self) -> RemotePrefill: ...

    @property
    def handback(self) -> HandBack: ...

    @property
    def probe(self) -> PrefillProbe: ...


class Serving:
    def __init__(self, inst: ServingHost) -> None:
        self.inst = inst
        self.queues: dict[str, asyncio.Queue[Event | Exception]] = {}
        self._ended: dict[str, str] = {}  # finish reasons set by the caller (a stop string matched)
        # a prompt that may be prefilled elsewhere than the router said (it sent PREFILL_FALLBACK_HEADER): one a
        # converted decoder was sent to prefill itself, which it may hand to that prefill engine (on arrival or under
        # its hand-back watch), or one a converted decoder prefills for this engine, which it may decline or hand
        # back. rid -> (the answer's HandedBack once settled, or None: prefilled where the router said; the engine the
        # router named, None: this one). Settled (`decide`) as soon as who prefills it is known: the prefill op of a
        # hand-back went out to its prefill engine (RemotePrefill, `settles`), it is to be prefilled here after all,
        # or its first event came (from the engine named). server.py answers such a request only once settled, so the
        # router moves its accounting then. Settled at the first token only (before), the router counted the
        # prompt on the engine that gave it away until its first token, timed that engine's first token (P's TTFT of a
        # handed-back prompt read ~0), and named it in X-Kascade-Prefilled-By. A prefill engine that took the op and
        # then fails leaves the answer naming it while this engine prefills the prompt (as in plain PD).
        self.decisions: dict[str, tuple[asyncio.Future[HandedBack | None], str | None]] = {}
        self.wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shed_logged, self._shed_count = -SHED_LOG_EVERY_S, 0

    @property
    def idle(self) -> bool:
        return self.inst.engine.scheduler.idle

    def start(self) -> None:
        if self._loop_task is None:
            self._loop = asyncio.get_running_loop()
            self._loop_task = asyncio.create_task(self._run())

    def publish(self, events: list[Event]) -> None:
        """Events made inside a step, before it ends (a live pair's tokens that landed while this engine's
        own step ran: pairclient.py), routed to their requests at once. Safe from the step thread; they
        reach the queues ahead of the step's own events (call_soon_threadsafe is FIFO)."""
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(self._route, events)

    def expect(self, rid: str, named: str | None) -> None:
        """`rid` may be prefilled elsewhere than on `named` (the engine the router named; None: this one)."""
        self.decisions[rid] = (asyncio.get_running_loop().create_future(), named)

    def decide(self, rid: str, by: str | None) -> None:
        """`rid` is prefilled by `by` (a prefill engine's data address; None: this engine): its answer says so when
        that is not the engine the router named. Once: the first call settles it."""
        entry = self.decisions.pop(rid, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(None if by == entry[1] else HandedBack(by))

    def drop(self, rid: str) -> None:
        """`rid` ended before anything was settled: its answer names no hand-back."""
        entry = self.decisions.pop(rid, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(None)

    def watched(self, rids: list[str]) -> list[asyncio.Future[HandedBack | None]]:
        """The hand-back questions of `rids` still open (taken now: `decide` drops them once settled)."""
        return [e[0] for e in (self.decisions.get(r) for r in rids) if e is not None]

    def _route(self, events: list[Event]) -> None:
        now = time.monotonic()
        for ev in events:
            if self.decisions:  # its first event says who prefilled it: a prefill engine's KV, or this engine
                self.decide(ev.request, ev.prefilled_by)
            self.inst.metrics.observe_event(ev, now)
            waiting = self.queues.get(ev.request)
            if waiting is not None:
                waiting.put_nowait(ev)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None

    async def _run(self) -> None:
        metrics = self.inst.metrics
        while True:
            eng = self.inst.engine  # read each step: bind may rebuild it for another dtype
            if eng.idle:
                self.wake.clear()
                if eng.idle:  # a pair step may have arrived between the check and the clear
                    await self.wake.wait()
            try:
                events = await asyncio.to_thread(eng.step)
            except Exception as e:  # one failing step fails its requests, never the loop
                log.exception("engine step failed")
                for rid, q in list(self.queues.items()):
                    eng.abort(rid)
                    q.put_nowait(e)
                continue
            self._route(events)
            self.inst.probe.tick()  # a converted decoder's warm-up prompt ends once its rate is measured
            metrics.update(self.inst)

    # -- requests ------------------------------------------------------------------------------
    def check_prompt(self, prompt: list[int]) -> None:
        limit = self.inst.config.max_prompt_tokens
        if not prompt:
            raise RequestError(400, "prompt is empty", "prompt")
        if len(prompt) > limit:
            raise RequestError(400, f"prompt has {len(prompt)} tokens, the limit is {limit}", "prompt")
        vocab = self.inst.model.shape.vocab
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")

    def waiting_tokens(self) -> int:
        """Prompt tokens queued for a first step (the scheduler's waiting queue)."""
        return sum(s.prompt_len - s.computed for s in self.inst.engine.scheduler.queued())

    def shed_check(self, prompt_tokens: int) -> None:
        """Refuse (503 + Retry-After) a prompt that would take the waiting queue past --max-waiting-tokens."""
        limit = self.inst.config.max_waiting_tokens
        waiting = self.waiting_tokens()
        if waiting == 0 or waiting + prompt_tokens <= limit:
            return
        self.inst.metrics.shed.inc()
        self._shed_count += 1
        now = time.monotonic()
        if now - self._shed_logged >= SHED_LOG_EVERY_S:
            log.warning("shedding load: %d prompt tokens waiting (limit %d); %d requests refused since the last "
                        "report", waiting, limit, self._shed_count)
            self._shed_logged, self._shed_count = now, 0
        raise RequestError(503, f"engine overloaded: {waiting} prompt tokens waiting, limit {limit} "
                                f"(--max-waiting-tokens); retry later", None, "unavailable", retry_after_s=1)

    def submit(self, prompt: list[int], params: SamplingParams, prefill: str | None = None,
               fallback: str | None = None) -> str:
        """`prefill`: a prefill engine's data address (disaggregated serving): the prompt is prefilled there
        and its KV moves here (remote_prefill.py); without one, or when that fails, it is prefilled here.
        `fallback` (a converted decoder prefilling the prompt itself): a prefill engine's data address the prompt
        is handed to if the step budget leaves it no progress for the hand-back bound (handback.py)."""
        self.check_prompt(prompt)
        self.shed_check(len(prompt))
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        timeline.mark("submit", rid, phase=self.inst.phase.value, resident=self.inst.model.resident_prefix())
        self.queues[rid] = asyncio.Queue()
        if not self.inst.model.complete:
            if self.inst.pair is None:
                self.queues.pop(rid, None)
                raise RequestError(503, "engine is loading and has no cooperating peer")
            self.inst.metrics.live_split.inc()  # batched here, finished in the pair's batch (cooperation.py)
        sched = self.inst.engine.scheduler
        if sched.resident(params.max_tokens + len(prompt)) > sched.pool.capacity_tokens:
            self.queues.pop(rid, None)
            raise RequestError(400, f"prompt_len + max_tokens = {params.max_tokens + len(prompt)} exceeds the KV "
                               f"capacity of {self.inst.engine.scheduler.pool.capacity_tokens} tokens", "max_tokens")

        def go() -> None:
            self.inst.engine.submit(prompt, params, rid)
            self.wake.set()

        pair = self.inst.pair if not self.inst.model.complete else None
        try:
            if prefill is not None and pair is None:  # `fallback` here: where it goes if that peer hands it back
                if fallback is not None:  # the peer is a converted decoder: the answer waits to name who prefills
                    self.expect(rid, prefill)
                self.inst.remote_prefill.start(rid, prompt, params, prefill, go, fallback=fallback)
            elif pair is not None:  # live: now, or once the ZigZag schedule's prefix is resident
                pair.admit(rid, go, self.queues[rid].put_nowait, len(prompt))
            elif fallback is not None and self.inst.engine.limits.prefill_chunk_tokens is not None \
                    and self.inst.handback.after_s is not None:  # converted: it may go to the fallback
                self.expect(rid, None)
                if not self.inst.handback.on_arrival(rid, prompt, params, fallback, go):
                    go()
                    self.inst.handback.watch(rid, prompt, params, fallback)
            else:
                go()
        except ValueError as e:
            self.queues.pop(rid, None)
            self.drop(rid)
            raise RequestError(400, str(e), "max_tokens") from None
        self.inst.metrics.on_request(len(prompt))
        return rid

    async def tokens(self, rid: str) -> AsyncGenerator[Event, None]:
        """The request's events until it finishes; closing early (client gone) aborts it at once."""
        q = self.queues[rid]
        t0, first, reason, generated = time.monotonic(), True, "abort", 0
        t1 = t0  # the first token's time
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, Exception) or ev.token < 0:
                    reason = "error"
                    why = ev if isinstance(ev, Exception) else ev.reason
                    raise RequestError(500, f"engine failed on this request: {why}", None, "server_error")
                if first:
                    t1 = time.monotonic()
                    self.inst.metrics.observe_ttft(t1 - t0)
                    self.inst.metrics.observe_phases(ev.queued_s, t1 - t0)
                    first = False
                generated += 1
                if ev.finished:
                    reason = ev.reason or "stop"
                yield ev
                if ev.finished:
                    return
        finally:
            self.queues.pop(rid, None)
            self.drop(rid)
            self.inst.metrics.on_finish(self._ended.pop(rid, reason), time.monotonic() - t0, generated,
                                        None if first else time.monotonic() - t1)
            if rid in self.inst.engine.requests or reason == "abort":  # the client went away: free its pages
                # (or abort it on the live pair it was redirected to)
                self.abort(rid)

    def abort(self, rid: str) -> None:
        self.drop(rid)
        self.inst.engine.abort(rid)
        for (
            fwd
        ) in self.inst.forwarders.values():  # a request handed to another engine (liveredirect.py): abort it there
            fwd.abort(rid)
        self.wake.set()

    def stop(self, rid: str) -> None:
        """The caller ends the request early on purpose (a stop string matched): counted as `stop`."""
        self._ended[rid] = "stop"
        self.abort(rid)


async def handed_back(watched: list[asyncio.Future[HandedBack | None]]) -> HandedBack | None:
    """Once each of these hand-back questions is settled: where one prompt was handed to, or None."""
    out = None
    for f in watched:
        out = await asyncio.shield(f) or out
    return out
