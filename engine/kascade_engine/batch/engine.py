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
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from kascade_engine.batch.decodebatch import DecodeBatch
from kascade_engine.batch.graphs import DecodeGraphs
from kascade_engine.batch.kvcache import KVCache, build_batch
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.recorder import StepRecorder
from kascade_engine.batch.sampling import SamplingParams, TokenLogprob, pick
from kascade_engine.batch.scheduler import Limits, Scheduler, Seq, Work
from kascade_engine.batch.stepcost import StepCost
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
    scheduled_at: float | None = None  # its first chunk's step began (queue time = scheduled_at - arrival)
    lp: TokenLogprob | None = None  # the logprobs of the token just sampled (params.logprobs set)
    # greedy with no logit processor and no logprobs: its token is the plain argmax (Engine._sample's fast path)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = p.temperature <= 0 and not p.penalised and p.min_tokens == 0 and p.logprobs is None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        """len(tokens), without building the list."""
        return len(self.prompt) + len(self.out)

    def span(self, a: int, b: int) -> list[int]:
        """tokens[a:b], without copying the whole context (a decode's is one output token)."""
        p = len(self.prompt)
        if a >= p:
            return self.out[a - p:b - p]
        return self.prompt[a:b] + self.out[:max(0, b - p)]


# slots, not frozen: a frozen dataclass sets every field through object.__setattr__ (3x the cost; a step makes one
# Event per sequence). Treated as immutable all the same; hashable like a frozen one (unsafe_hash).
@dataclass(slots=True, unsafe_hash=True)
class Event:
    request: str
    token: int
    finished: bool
    reason: str | None = None  # "stop" | "length" | "error: <message>" (token -1)
    # the first token of a prompt prefilled on another engine (remote_prefill.py): that engine's data address. A
    # converted decoder's answer names who prefilled its prompt from it (serving.Serving.decide), not from the
    # hand-back's intent: a hand-back whose remote prefill failed is prefilled here after all
    prefilled_by: str | None = None
    queued_s: float | None = None  # on a first token prefilled here: seconds from arrival to its first step
    logprob: TokenLogprob | None = None  # asked for (params.logprobs) and sampled on this engine


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


@runtime_checkable
class WrappingHooks(StepHooks, Protocol):
    """A hook that runs another one (`inner`) and adds to it (pd/prefill_server.py `KVShipper`): installed once
    (`Engine.wrap_hook`), it stays when the hook it wraps is replaced (`Engine.set_hook`, `Engine.step_down`)."""

    inner: StepHooks | None


W = TypeVar("W", bound=WrappingHooks)


class Engine:
    def __init__(self, model: LlamaModel, limits: Limits | None = None, eos: int | None = None,
                 cuda_graphs: bool = True) -> None:
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
        # decode steps replayed as CUDA graphs per batch-size bucket (graphs.py); None off CUDA or when turned off
        self.graphs = DecodeGraphs.for_engine(model, self.cache, self.limits.max_seqs, self.limits.pages - 1,
                                              cuda_graphs)
        # an all-decode step's batch, advanced in place while the rows stay the same (not with page reclaim: dropped
        # pages change a block table in place)
        self.decoding = DecodeBatch(self.cache) if reclaim is None else None
        # the sampled ids of the last step, kept on the device when every row of an all-decode step took the plain
        # argmax: the next step's input ids when the decode batch advanced in place (the same rows, in the same
        # order, each one token on: row i's last token is its sampled id). `_fed`: the previous step's, read in
        # this step's `_hidden`
        self._carry: torch.Tensor | None = None
        self._fed: torch.Tensor | None = None
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
        # the step's bookkeeping: velocity, step cost, the budget's record (recorder.py; metrics.py reads it)
        self.recorder = StepRecorder(self.scheduler, self.meter, self.cost)
        self.coop: StepHooks | None = None  # live split hook (cooperation.py): hosts or sends pair rows
        # `coop` changes in the event loop (a new pair, a KV shipper) and in the step thread (a pair stepping down):
        # each change is a read-then-write under this lock, so one never undoes the other (a step reads it once)
        self._coop_lock = threading.Lock()

    def set_hook(self, hook: StepHooks | None) -> None:
        """Make `hook` the step hook (a new live pair, or the hosted rows again), under a wrapper if one is
        installed: a prefill engine's KV shipper stays, and so do the sinks its remote prompts wait on."""
        with self._coop_lock:
            if isinstance(self.coop, WrappingHooks):
                self.coop.inner = hook
            else:
                self.coop = hook

    def step_down(self, hook: StepHooks, to: StepHooks | None) -> bool:
        """`hook` hands the step over to `to` (a live pair once nothing runs split), if it still is the step hook
        (itself or under a wrapper); False: it was replaced meanwhile, and that replacement stays."""
        with self._coop_lock:
            if self.coop is hook:
                self.coop = to
            elif isinstance(self.coop, WrappingHooks) and self.coop.inner is hook:
                self.coop.inner = to
            else:
                return False
            return True

    def wrap_hook(self, kind: type[W], wrap: Callable[[StepHooks | None], W]) -> W:
        """The installed wrapper of type `kind`, or `wrap(current hook)` installed now (once)."""
        with self._coop_lock:
            if not isinstance(self.coop, kind):
                self.coop = wrap(self.coop)
            return self.coop

    @property
    def idle(self) -> bool:
        """Nothing to step: no sequences and no pair rows waiting."""
        return self.scheduler.idle and not self._inbox and not ((c := self.coop) is not None and c.pending())

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

    # -- a request's KV between engines (disaggregated serving: pd/) ---------------------------------------------
    # The whole model's KV heads in host memory, [layers, n, kv_heads, head_dim]: what a prefill engine ships and a
    # decode engine installs, whatever the engines' tensor parallelism (tp/leader.py gathers it from, and scatters
    # it to, the ranks of a tensor-parallel instance).
    layerwise = True  # a step's layers can run one at a time in this process (not a TP instance: its ranks follow)
    # processes this engine's heads are split over (tp/leader.py: read_kv, write_kv and run_rows are collectives)
    tp: int = 1

    def run_rows(self, first: int, last: int, x: torch.Tensor,
                 items: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Layers first..last-1 over hidden states `x` [N, H] whose chunks are `items` (page table, start, tokens):
        a live pair's partial forward (live/cooperation.py `staggered`). tp/leader.py sends it to every rank first."""
        return self.model.run_layers(first, last, x, build_batch(self.cache, items))

    @property
    def kv_heads(self) -> int:
        """The whole model's KV heads (what `read_kv` returns and `write_kv` takes)."""
        return self.cache.kv_heads

    def read_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of cache `slots` over every layer, [layers, n, kv_heads, head_dim] each, new host tensors (the
        pages may be reused once the step ends). Called in the step thread, between forwards."""
        c = self.cache
        return c.k.index_select(1, slots).cpu(), c.v.index_select(1, slots).cpu()

    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`read_kv`'s inverse: K and V [layers, n, kv_heads, head_dim] (host) into cache `slots` of every layer."""
        c = self.cache
        for layer in range(c.layers):
            c.k[layer].index_copy_(0, slots, k[layer].to(c.device))
            c.v[layer].index_copy_(0, slots, v[layer].to(c.device))

    def _apply_aborts(self, coop: StepHooks | None) -> None:
        while self._aborts:
            rid = self._aborts.pop()
            self.scheduler.finish(rid)
            self.requests.pop(rid, None)
            if coop is not None:  # a request handed to a live pair (redirect.py): abort it there
                coop.abort(rid)

    def step(self) -> list[Event]:
        """schedule -> forward -> sample -> postprocess; the step's timing goes to the recorder."""
        self._fed, self._carry = self._carry, None
        # the step's hook, read once: the event loop may replace `coop` meanwhile (peering.py: a new pair), and the
        # hook itself may step down inside its forward (pairclient.py: a plain engine again); the hook that ran the
        # step prepares it and hands over the tokens that landed in it (reading `self.coop` again lost them)
        coop = self.coop
        events = self._prepare(coop)
        work = self._schedule()
        if not work and not (coop is not None and coop.pending()):
            return events
        self.steps += 1
        now = time.monotonic()
        rs = [self.requests[w.id] for w in work]
        if None in [r.scheduled_at for r in rs]:
            for r in rs:
                if r.scheduled_at is None:
                    r.scheduled_at = now
        # which chunks sample, fixed before the forward: a live pair's answer to this very step can land inside
        # it (pairclient.PairClient lands every answer that is back), adding the token (len(tokens) grows) or
        # finishing the request (it leaves `requests`); the recorder's facts likewise
        samples = [w.start + w.n == len(r.prompt) + len(r.out) for w, r in zip(work, rs, strict=True)]
        note = self.recorder.begin(work, self.requests, coop, rs)
        t0 = time.perf_counter()
        toks: Sequence[int | None]
        try:
            if coop is None:
                with torch.inference_mode():  # once for the step's model calls (model.inference)
                    toks = self._forward(work, rs, samples)
            else:
                toks = coop.forward(self, work)
        except (RuntimeError, ValueError, IndexError) as e:  # fails this step's requests, never the engine
            return events + self._fail(work, e)
        self.recorder.end(note, work, time.perf_counter() - t0)
        return events + self._postprocess(work, samples, toks, coop)

    def _prepare(self, coop: StepHooks | None) -> list[Event]:
        """Aborts, work handed over by the event loop, and the step hook's turn, before the schedule."""
        self._apply_aborts(coop)
        events: list[Event] = []
        while self._inbox:
            events.extend(self._inbox.popleft()(self))
        if coop is not None:
            coop.prepare(self)
        return events

    def _schedule(self) -> list[Work]:
        reqs = self.requests
        work = [w for w in self.scheduler.schedule().work if w.id in reqs]
        if max([w.n for w in work], default=1) == 1:
            return work
        return [w for w in work if w.n == 1] + [w for w in work if w.n > 1]  # decodes first (a stable partition)

    def _forward(self, work: list[Work], rs: list[Request] | None = None,
                 samples: list[bool] | None = None) -> list[int]:
        """One forward for the whole step; returns the sampled token per sampling chunk, in order. `rs` (each
        chunk's request) and `samples` (which chunks sample), when the caller has them, save a pass each."""
        rs, samples = self._rows(work, rs, samples)
        every = all(samples)
        sampling = rs if every else [r for r, s in zip(rs, samples, strict=True) if s]
        return self._sample(sampling, self._logits(work, rs, samples), every)

    def _rows(self, work: list[Work], rs: list[Request] | None,
              samples: list[bool] | None) -> tuple[list[Request], list[bool]]:
        """Each chunk's request and whether it samples (reaches its last known token), unless given."""
        if rs is None:
            reqs = self.requests
            rs = [reqs[w.id] for w in work]
        if samples is None:
            samples = [w.start + w.n == len(r.prompt) + len(r.out) for w, r in zip(work, rs, strict=True)]
        return rs, samples

    def _logits(self, work: list[Work], rs: list[Request] | None = None,
                samples: list[bool] | None = None) -> torch.Tensor:
        """The model over every chunk's tokens at once; logits only for chunks that reach their last token
        (`samples`)."""
        rs, samples = self._rows(work, rs, samples)
        every = all(samples)
        m, tables = self.model, self.scheduler.pool.tables
        items = [(tables[w.id], w.start, w.n) for w in work]
        if max([w.n for w in work]) == 1:  # decodes: one token each (the last known one, nearly always an output)
            ids = [r.out[w.start - p] if w.start >= (p := len(r.prompt)) else r.prompt[w.start]
                   for w, r in zip(work, rs, strict=True)]
            rows = list(range(len(ids))) if every else [i for i, e in enumerate(samples) if e]
        else:
            ids, rows = [], []
            for w, r, e in zip(work, rs, samples, strict=True):
                ids.extend(r.span(w.start, w.end))
                if e:
                    rows.append(len(ids) - 1)
        if self.graphs is not None and len(rows) == len(ids) == len(items):  # all decodes: maybe a graph replay
            out = self.graphs.logits(ids, items)
            if out is not None:
                return out
        h = self._hidden(ids, items)
        if len(rows) == len(ids):  # every token samples (all decodes): no row to pick
            return m.logits(h)
        return m.logits(h[torch.tensor(rows, dtype=torch.long, device=m.device)])

    def _hidden(self, ids: list[int], items: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """The last layer's hidden states over a step's tokens; items: (page table, start, tokens) per chunk
        (tp/leader.py announces the step to the other ranks first). An all-decode step advances the persistent
        decode batch (decodebatch.py); any other step builds its batch from the lists."""
        m, fed = self.model, self._fed
        self._fed = None
        if self.decoding is not None and len(ids) == len(items):
            batch = self.decoding.forward_batch(items)
            if fed is not None and self.decoding.advanced and fed.shape[0] == len(ids):
                return m.run_layers(0, m.shape.layers, m.embed(fed), batch)  # last step's argmax: no ids copy
        else:
            if self.decoding is not None:
                self.decoding.reset()
            batch = build_batch(self.cache, items)
        return m.run_layers(0, m.shape.layers, m.embed(torch.tensor(ids, dtype=torch.long, device=m.device)), batch)

    def _sample(self, rs: list[Request], logits: torch.Tensor, every: bool = False) -> list[int]:
        """One token per row of `logits`; `rs`: the request of each row; `every`: every chunk of the step samples
        (an all-decode step's argmax can then feed the next step, `_carry`)."""
        if all([r.plain for r in rs]):  # greedy with default processors: the argmax is `pick`'s answer
            t = logits.argmax(dim=-1)
            if every and self.coop is None and self.decoding is not None:
                self._carry = t
            out: list[int] = t.tolist()
            return out
        return pick(logits, rs, self.eos)

    def _fail(self, work: list[Work], e: Exception) -> list[Event]:
        log.warning("step failed for %d requests: %s", len(work), e, exc_info=log.isEnabledFor(logging.INFO))
        for w in work:
            self.scheduler.finish(w.id)
            self.requests.pop(w.id, None)
        return [Event(w.id, -1, True, f"error: {e}") for w in work]

    def _postprocess(self, work: list[Work], samples: list[bool], toks: Sequence[int | None],
                     coop: StepHooks | None) -> list[Event]:
        """Advance every chunk; a sampled token ends its request on stop/length. A chunk that samples takes the next
        of `toks`; None there: still out on a live pair (cooperation.py parked it), delivered when it lands."""
        if len(toks) == len(work) and coop is None:  # every chunk sampled here (an all-decode step)
            self.scheduler.advance_all(work, samples)
            return self.deliver_all([w.id for w in work], toks, time.monotonic())  # type: ignore[arg-type]
        it = iter(toks)
        got = [next(it) if sampled else None for sampled in samples]
        self.scheduler.advance_all(work, [t is not None for t in got])
        kept = [(w.id, t) for w, t in zip(work, got, strict=True) if t is not None]
        events = self.deliver_all([rid for rid, _ in kept], [t for _, t in kept], time.monotonic())
        if coop is not None:
            events.extend(coop.take_events())  # tokens that landed from a live pair (own or redirected)
        return events

    def deliver(self, rid: str, tok: int, now: float) -> Event:
        """`tok` is `rid`'s next token (its step's KV already counted): record it, finish on stop/length."""
        return self.deliver_all([rid], [tok], now)[0]

    def deliver_all(self, rids: Sequence[str], toks: Sequence[int], now: float) -> list[Event]:
        """`deliver` for each request id and its token, in one loop (a step's decodes)."""
        events: list[Event] = []
        reqs, eos = self.requests, self.eos
        for rid, tok in zip(rids, toks, strict=True):
            r = reqs[rid]
            out, p = r.out, r.params
            out.append(tok)
            n = len(out)
            if r.first_token_at is None:
                r.first_token_at = now
            reason = None
            if n >= p.min_tokens and ((tok == eos and not p.ignore_eos) or tok in p.stop_token_ids):  # stops_here
                reason = "stop"
            elif n >= p.max_tokens:
                reason = "length"
            if reason:
                self.scheduler.finish(rid)
                reqs.pop(rid, None)
            queued = r.scheduled_at - r.arrival if n == 1 and r.scheduled_at is not None else None
            lp = r.lp
            if lp is not None:
                r.lp = None
            events.append(Event(rid, tok, reason is not None, reason, None, queued, lp))
        return events

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
