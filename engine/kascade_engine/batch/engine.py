"""The engine core: one model, its paged KV cache, the scheduler, and the per-request state.

Data flow: `submit(prompt_ids, params)` -> scheduler queue -> `step()`: the scheduler picks this step's
chunks (decodes, prefill chunks, newly admitted prompts; see scheduler.py) -> one flat [N] token batch
-> embed -> every layer once for all N tokens (model.run_layers; attention per group on the paged
cache) -> logits only for sequences whose chunk reached their last known token -> sampled tokens ->
`Event`s (request id, token, finished) -> the server streams them. `abort(id)` (client gone) frees the
sequence's pages before the next step's schedule.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kascade_engine.batch.kvcache import KVCache, build_batch
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams, sample
from kascade_engine.batch.scheduler import Limits, Scheduler, Seq, Work
from kascade_engine.batch.stepcost import StepCost, StepShape
from kascade_engine.batch.velocity import VelocityMeter

log = logging.getLogger(__name__)


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    out: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    gen: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclass(frozen=True)
class Event:
    request: str
    token: int
    finished: bool
    reason: str | None = None  # "stop" | "length" | "error: <message>" (token -1)
    # the first token of a prompt prefilled on another engine (remote_prefill.py): that engine's data address. A
    # converted decoder's answer names who prefilled its prompt from it (serving.Serving.decide), not from the
    # hand-back's intent: a hand-back whose remote prefill failed is prefilled here after all
    prefilled_by: str | None = None


# Step hooks: what the live-scaling and disaggregation wings plug into a step, as a protocol owned by the
# batching core (so batch/ imports nothing above it). `prepare` runs before each schedule, `forward` in place of
# the engine's own forward, `take_events` yields tokens that landed later. Implementations: live/cooperation.py
# `HostRows` (a full engine hosting a loading peer's rows), live/pairclient.py `PairClient` (a loading engine),
# pd/prefill_server.py `KVShipper`.
class StepHooks(Protocol):
    """An Engine hook: `forward` replaces the step's forward; `pending` keeps the loop stepping."""

    def pending(self) -> bool: ...

    def forward(self, engine: Engine, work: list[Work]) -> Sequence[int | None]: ...
    # one token per sampling chunk, in order; None: that chunk's token lands later (take_events)

    def prepare(self, engine: Engine) -> None: ...  # before each schedule (in the step thread)

    def abort(self, rid: str) -> None: ...

    def take_events(self) -> list[Event]: ...


class Engine:
    def __init__(self, model: LlamaModel, limits: Limits | None = None, eos: int | None = None) -> None:
        self.model = model
        self.limits = limits or Limits()
        windows = model.windows
        # pages can go only when every layer has a window (they share one block table per sequence)
        reclaim = max(w for w in windows if w is not None) if windows and None not in windows else None
        self.scheduler = Scheduler(self.limits, window=reclaim)
        s = model.shape
        self.cache = KVCache(s.layers, self.limits.pages, self.limits.page_size, s.kv_heads, s.head_dim,
                             model.dtype, model.device, reuse_gather=True)
        self.requests: dict[str, Request] = {}
        self.eos = eos
        self._ids = itertools.count()
        self._aborts: set[str] = set()
        # work handed over by the event loop, run at the start of the next step in the step thread (a
        # remotely prefilled sequence joining the batch: remote_prefill.py); returns that step's events
        self._inbox: deque[Callable[[Engine], list[Event]]] = deque()
        self.steps = 0
        self.meter = VelocityMeter()  # prefill/decode tokens/s measured from this engine's step timings
        # step time as a function of what the step runs, fitted from this engine's own steps: a converted
        # decoder's scheduler cuts prompt chunks to the time its step budget leaves (stepcost.py)
        self.cost = self.scheduler.cost = StepCost()
        # the last step as (prompt tokens prefilled, decode rows, seconds), and the most prompt tokens one step
        # prefilled under the chunk budget in force now (`budget_of_max`; a new budget starts it again): what a
        # converted decoder's /metrics shows to prove its budget held (metrics.py)
        self.last_step: tuple[int, int, float] | None = None
        self.prefill_step_max = 0
        self.budget_of_max: int | None = None
        self.coop: StepHooks | None = None  # live split hook (cooperation.py): hosts or sends pair rows

    @property
    def idle(self) -> bool:
        """Nothing to step: no sequences and no pair rows waiting."""
        return self.scheduler.idle and not self._inbox and not (self.coop is not None and self.coop.pending())

    def reset(self) -> None:
        """Forget every request (release: the instance holds nothing afterwards)."""
        for rid in list(self.requests):
            self.scheduler.finish(rid)
        self.requests.clear()

    def load_blocks(self, blocks: Iterable[Any]) -> None:
        for b in blocks:
            self.model.add_block(b.id, b.tensors())

    def submit(self, prompt: list[int], params: SamplingParams, rid: str | None = None, front: bool = False,
               arrived: float | None = None) -> str:
        """Queue a request (by `arrived`, a `time.monotonic()` value, default now: last unless some waiting
        prompt arrived later; or first with `front`); returns its id."""
        if not prompt:
            raise ValueError("prompt is empty")
        rid = rid or f"req-{next(self._ids)}"
        gen = None
        if params.seed is not None:  # sampling draws on the CPU generator: same tokens on any device
            try:  # before the scheduler sees the request: a bad seed must leave no sequence behind
                gen = torch.Generator(device="cpu").manual_seed(params.seed)
            except (RuntimeError, OverflowError, TypeError) as e:
                raise ValueError(f"seed {params.seed!r} is not usable: {e}") from None
        when = time.monotonic() if arrived is None else arrived
        self.scheduler.add(Seq(rid, len(prompt), params.max_tokens, arrived=when), front)
        self.requests[rid] = Request(rid, list(prompt), params, gen=gen)
        return rid

    def abort(self, rid: str) -> None:
        """Safe from another thread while `step` runs: applied at the start of the next step."""
        self._aborts.add(rid)

    def call_in_step(self, fn: Callable[[Engine], list[Event]]) -> None:
        """Run `fn(self)` in the step thread before the next schedule (safe from the event loop)."""
        self._inbox.append(fn)

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.pop()
            self.scheduler.finish(rid)
            self.requests.pop(rid, None)
            if self.coop is not None:  # a request handed to a live pair (redirect.py): abort it there
                self.coop.abort(rid)

    def _forward(self, work: list[Work]) -> list[int]:
        """One forward for the whole step; returns the sampled token per sampling chunk, in order."""
        m, pool = self.model, self.scheduler.pool
        ids: list[int] = []
        rows: list[int] = []
        for w in work:
            ids.extend(self.requests[w.id].tokens[w.start:w.end])
            if w.end == len(self.requests[w.id].tokens):
                rows.append(len(ids) - 1)
        batch = build_batch(self.cache, [(pool.tables[w.id], w.start, w.n) for w in work])
        h = m.run_layers(0, m.shape.layers, m.embed(torch.tensor(ids, dtype=torch.long, device=m.device)), batch)
        logits = m.logits(h[torch.tensor(rows, dtype=torch.long, device=m.device)])
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        sampled = [w for w in work if w.end == len(self.requests[w.id].tokens)]
        for j, w in enumerate(sampled):
            r = self.requests[w.id]
            out.append(greedy[j] if r.params.temperature <= 0 else sample(logits[j].cpu(), r.params, r.gen))
        return out

    def step(self) -> list[Event]:
        self._apply_aborts()
        events: list[Event] = []
        while self._inbox:
            events.extend(self._inbox.popleft()(self))
        if self.coop is not None:
            self.coop.prepare(self)
        batch = self.scheduler.schedule()
        work = sorted((w for w in batch.work if w.id in self.requests), key=lambda w: w.n > 1)  # decodes first
        if not work and not (self.coop is not None and self.coop.pending()):
            return events
        self.steps += 1
        # which chunks sample, and the prefill sizes, fixed before the forward: a live pair's answer to this
        # very step can land inside it (pairclient.PairClient lands every answer that is back), adding the
        # token (len(tokens) grows) or finishing the request (it leaves `requests`)
        samples = [w.end == len(self.requests[w.id].tokens) for w in work]
        prefill = [(w.n, len(self.requests[w.id].prompt)) for w in work if w.start < len(self.requests[w.id].prompt)]
        pending = self.scheduler.prompts_pending()  # before `advance`: this step's own prompt chunks count
        # its prompt tokens were limited by the step's token cap or budget while more waited: only such a step's
        # tokens/s is the engine's prefill capacity (velocity.py; read now: the next schedule overwrites it)
        saturated = self.scheduler.last_saturated
        # the prefill rate is what the budgets give a prompt: a step whose chunk the step budget could not cut yet
        # (no prompt token timed) ran under the token cap alone, and counting it reported a rate the budget never
        # gives (bench/pd.py 2026-11-27-d run 7: 306.7 tok/s on D's first prompt, ~0 a second later)
        budgeted = self.scheduler.last_budget_s is None or (
            self.scheduler.cost is not None and self.scheduler.cost.token_s is not None)
        # a converted decoder with no prompt waiting: the tokens its budgets would give one beside these decodes
        room = None if pending else self.scheduler.known_room()
        # a step that also runs a live pair's rows (hosted, or out on the peer) times more than this engine's work
        own = self.coop is None or not self.coop.pending()
        t0 = time.perf_counter()
        try:
            toks = self._forward(work) if self.coop is None else self.coop.forward(self, work)
        except (RuntimeError, ValueError, IndexError) as e:  # fails this step's requests, never the engine
            log.warning("step failed for %d requests: %s", len(work), e, exc_info=log.isEnabledFor(logging.INFO))
            for w in work:
                self.scheduler.finish(w.id)
                self.requests.pop(w.id, None)
            return events + [Event(w.id, -1, True, f"error: {e}") for w in work]
        secs = time.perf_counter() - t0
        self.meter.observe(prefill, len(work) - len(prefill), secs, saturated=saturated)
        tokens = sum(n for n, _ in prefill)
        if own:
            self.cost.observe(StepShape.of([(w.start, w.n) for w in work]), secs)
            if pending and budgeted:
                self.meter.observe_rate(tokens, secs)
            elif room is not None:  # what a prompt would have got, the chunk's predicted time added to the step's
                self.meter.observe_rate(room, secs + room * (self.cost.token_s or 0.0))
        self.last_step = (tokens, len(work) - len(prefill), secs)
        if self.scheduler.last_cap != self.budget_of_max:
            self.budget_of_max, self.prefill_step_max = self.scheduler.last_cap, 0
        self.prefill_step_max = max(self.prefill_step_max, tokens)
        it = iter(toks)
        now = time.monotonic()
        for w, sampled in zip(work, samples, strict=True):
            if not sampled:  # a prefill chunk that did not reach the end yet
                self.scheduler.advance(w.id, w.n, False)
                continue
            tok = next(it)
            if tok is None:  # still out on a live pair (cooperation.py parked it): delivered when it lands
                self.scheduler.advance(w.id, w.n, False)
                continue
            self.scheduler.advance(w.id, w.n, True)
            events.append(self.deliver(w.id, tok, now))
        if self.coop is not None:
            events.extend(self.coop.take_events())  # tokens that landed from a live pair (own or redirected)
        return events

    def deliver(self, rid: str, tok: int, now: float) -> Event:
        """`tok` is `rid`'s next token (its step's KV already counted): record it, finish on stop/length."""
        r = self.requests[rid]
        r.out.append(tok)
        r.first_token_at = r.first_token_at or now
        reason = None
        if tok == self.eos or tok in r.params.stop_token_ids:
            reason = "stop"
        elif len(r.out) >= r.params.max_tokens:
            reason = "length"
        if reason:
            self.scheduler.finish(rid)
            self.requests.pop(rid, None)
        return Event(rid, tok, reason is not None, reason)

    def generate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """Run one request to completion (tests, benchmarks)."""
        return self.generate_many([prompt], params)[0]

    def generate_many(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run requests together to completion (tests, benchmarks): batched like the server does."""
        rids = [self.submit(p, params) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        done: set[str] = set()
        while len(done) < len(rids):
            before = self.steps
            events = self.step()
            if self.steps == before:
                raise RuntimeError("nothing schedulable: the requests do not fit the KV cache")
            for e in events:
                if e.request in out:
                    if e.token < 0:
                        raise RuntimeError(f"generation failed: {e.reason}")
                    out[e.request].append(e.token)
                    if e.finished:
                        done.add(e.request)
        return [out[r] for r in rids]
