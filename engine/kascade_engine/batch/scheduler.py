"""Scheduler: continuous batching with chunked prefill over a paged KV cache, pure python (no torch).

Each sequence has `total` known tokens (prompt + generated) of which `computed` have K/V cached. A step
gives every scheduled sequence a chunk `Work(start=computed, n)`: running decodes first (n = 1: keeps
inter-token latency low), then unfinished prefills, then waiting sequences admitted FCFS, all within
`max_batch_tokens` (chunked prefill: a long prompt takes several steps, mixed with decodes) and
`max_seqs`. Admission needs free pages for the sequence's known tokens; a running sequence that needs a
page when none is free preempts the most recently admitted sequence not yet in this step (its pages
are freed and it is recomputed from its known tokens when re-admitted, so its output is unchanged).
`finish(id)` (done, aborted, failed) frees the pages at once. `park(id)` takes a running sequence out of
scheduling while its step is still out on a live pair (cooperation.py: a loading engine keeps two steps
in flight); `unpark(id, sampled)` brings it back when that step's answer lands. A parked sequence keeps
its pages and its seat (max_seqs) and is never preempted. With `window` set (a model whose every
layer attends only to the last `window` positions), pages wholly before the window of a sequence's next
chunk go back to the pool before it grows, so a long generation holds about window/page_size pages.

Threads: the event loop queues (`add`) while the step thread schedules, preempts and finishes. Every change
of `waiting` holds `_queue_lock` (an `add` beside a `finish` that rebuilt the queue lost the request or failed
the whole step with "deque mutated during iteration"), and so does every read of more than its length or
head: `queued()`. A `tuple(waiting)` is one C call but not atomic: the tuple's allocation may run the cyclic GC,
whose finalizers may let the other thread run and change the queue mid-copy (a request's handler then raised
"deque mutated during iteration": an HTTP 500). The same holds the other way for `joining` (the event loop changes
it, the step thread copies it): `_joining_lock`, `expect` / `landed` / `joining_prompts()`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kascade_engine.batch.budget import PrefillBudget
from kascade_engine.batch.pages import PagePool
from kascade_engine.batch.stepcost import StepCost, StepShape


@dataclass
class Seq:
    id: str
    prompt_len: int
    max_tokens: int
    total: int = 0  # known tokens: prompt + generated
    computed: int = 0  # tokens whose K/V is in the cache
    generated: int = 0
    # when the prompt arrived, on this engine's monotonic clock: the waiting queue is kept in this order (FCFS);
    # a prompt a converted decoder hands back arrives with the time it already waited (kv_wire.PrefillOp)
    arrived: float = 0.0

    def __post_init__(self) -> None:
        self.total = self.total or self.prompt_len


@dataclass(slots=True, unsafe_hash=True)  # not frozen: one per sequence per step (see engine.Event)
class Work:
    id: str
    start: int
    n: int

    @property
    def end(self) -> int:
        return self.start + self.n


@dataclass(frozen=True)
class Batch:
    work: tuple[Work, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.work


@dataclass
class Limits:
    max_batch_tokens: int = 512
    max_seqs: int = 64
    kv_tokens: int = 16384
    page_size: int = 16
    prefill_chunk_tokens: int | None = None  # convertible decoder: prompt tokens per step at most (None: no cap)
    # convertible decoder: a step that decodes takes prompt tokens only while its predicted time (the engine's
    # measured step cost, stepcost.py) stays within this many seconds (the TBT objective's room; None: no limit)
    step_budget_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_seqs", "kv_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler limit {name} must be >= 1, got {getattr(self, name)}")
        if self.step_budget_s is not None and not self.step_budget_s > 0:
            raise ValueError(f"scheduler limit step_budget_s must be > 0 or None, got {self.step_budget_s}")

    @property
    def pages(self) -> int:
        """Pages in the pool: enough for kv_tokens, plus the reserved zero page."""
        return -(-self.kv_tokens // self.page_size) + 1


@dataclass
class Scheduler:
    limits: Limits = field(default_factory=Limits)
    waiting: deque[Seq] = field(default_factory=deque)
    running: dict[str, Seq] = field(default_factory=dict)  # admission order
    parked: dict[str, Seq] = field(default_factory=dict)  # their last step is still out on a live pair
    preemptions: int = 0
    window: int | None = None  # every layer's attention window (None: some layer sees the whole context)
    dropped_pages: int = 0
    # a live pair's loading engine (pairclient.py): a waiting prompt that fits a step whole is not split
    # across two, as each step of it is a pair round trip (B's prefix, A's step boundary, A's step)
    whole_prompts: bool = False
    # the engine's step-time model (stepcost.py): with a step budget, prompt chunks are cut to the time left
    # after the step's decodes; None (or not yet measured) leaves the token cap alone in force
    cost: StepCost | None = None
    # a converted decoder's prefill budget (budget.py): the cap and step budget a schedule applies (`last_cap`,
    # `last_budget_s`, `cut_tokens` read through to it)
    prefill_budget: PrefillBudget = field(default_factory=PrefillBudget)
    # the last `schedule` was SATURATED for prefill: its token budget, prefill cap or time budget ran out while prompt
    # tokens still waited (queued, or left of a chunked prompt), so its prompt tokens per second measure what the
    # engine sustains when busy, not the load (velocity.VelocityMeter.observe: only such steps count as capacity).
    # A step held back by max_seqs, KV pages or a whole-prompt rule is not: it had room it could not fill
    last_saturated: bool = False
    # prompt lengths of this engine's requests a prefill engine prefills now (remote_prefill.RemotePrefill adds and
    # drops them: `expect`, `landed`): each joins the batch as a decode when its KV lands, within about the time a
    # prompt started here now would take to prefill, so `prefill_room` counts them. The event loop changes it, the
    # step thread reads it (the recorder's `known_room`): both under `_joining_lock`
    joining: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = PagePool(self.limits.pages, self.limits.page_size)
        self._queue_lock = threading.Lock()  # held by every change of `waiting` (see the module docstring)
        self._joining_lock = threading.Lock()  # held by every change and copy of `joining`

    @property
    def last_cap(self) -> int | None:
        return self.prefill_budget.last_cap

    @property
    def last_budget_s(self) -> float | None:
        return self.prefill_budget.last_budget_s

    @property
    def cut_tokens(self) -> int:
        return self.prefill_budget.cut_tokens

    def resident(self, tokens: int) -> int:
        """The most KV positions a sequence of `tokens` positions holds at once: all of them, or with a
        window the window before a chunk plus the chunk (plus a page of slack at each end)."""
        if self.window is None:
            return tokens
        return min(tokens, self.window + self.limits.max_batch_tokens + 2 * self.limits.page_size)

    def add(self, seq: Seq, front: bool = False) -> None:
        """Queue `seq` by its arrival (last unless a waiting prompt arrived after it: a handed-back prompt goes
        ahead of those), or first (`front`: it has waited longest, e.g. taken back from a live pair).
        Called from the event loop while the step thread schedules: under `_queue_lock`."""
        need = seq.prompt_len + seq.max_tokens
        if self.resident(need) > self.pool.capacity_tokens:
            raise ValueError(f"prompt_len + max_tokens = {need} exceeds the KV capacity of "
                             f"{self.pool.capacity_tokens} tokens")
        with self._queue_lock:
            if front:
                self.waiting.appendleft(seq)
                return
            q = self.waiting
            i = len(q)
            while i > 0 and q[i - 1].arrived > seq.arrived:
                i -= 1
            q.insert(i, seq)

    def queued(self) -> tuple[Seq, ...]:
        """The waiting queue as it is now, from either thread."""
        with self._queue_lock:
            return tuple(self.waiting)

    def kv_usage(self) -> float:
        return self.pool.usage

    def _preempt(self, s: Seq) -> None:
        self.pool.free(s.id)
        s.computed = 0
        del self.running[s.id]
        with self._queue_lock:
            self.waiting.appendleft(s)
        self.preemptions += 1

    def schedule(self) -> Batch:
        budget = self.limits.max_batch_tokens
        b = self.prefill_budget.begin(self.limits.prefill_chunk_tokens, self.limits.step_budget_s, budget,
                                      self._prefilling, self.cost)
        work: list[Work] = []
        scheduled: set[str] = set()
        preempted: list[str] = []
        dec_n = dec_keys = 0
        running, tables, ps = self.running, self.pool.tables, self.pool.page_size
        seqs = list(running.values())  # decodes first (a stable partition, no per-sequence key call)
        dec = [s for s in seqs if s.total - s.computed <= 1]
        pre = [s for s in seqs if s.total - s.computed > 1]
        order = dec + pre
        if self.window is None and dec and len(dec) <= min(budget, self.limits.max_seqs) and \
                all([s.total - s.computed == 1 for s in dec]):
            # every decode fits the step: what the loop below does for them, in a few list passes, unless a page
            # they need is not free (then the loop runs for them too and preempts)
            short = [s for s in dec if len(tables.get(s.id, ())) * ps <= s.computed]  # the next token opens a page
            if sum([self.pool.missing(s.id, s.computed + 1) for s in short]) <= self.pool.free_pages:
                for s in short:
                    self.pool.grow(s.id, s.computed + 1)
                work = [Work(s.id, s.computed, 1) for s in dec]
                scheduled = {s.id for s in dec}
                budget -= len(dec)
                dec_n, dec_keys = len(dec), max([s.computed + 1 for s in dec])
                order = pre
        for s in order:
            if budget <= 0 or len(scheduled) >= self.limits.max_seqs:
                break
            if s.id not in running:
                continue  # preempted earlier in this loop
            n = min(s.total - s.computed, budget)
            if n > 1:  # a prefill chunk (decodes are never capped)
                b.shape, dec_n, dec_keys = b.shape.with_decodes(dec_n, dec_keys), 0, 0  # the decodes before it
                n = b.timed(s.computed, min(n, b.prefill_left)) if b.prefill_left > 0 else 0
                if n <= 0:
                    continue
                b.prefill_left -= n
            if self.window is not None:  # queries at >= computed see keys > computed - window only
                self.dropped_pages += self.pool.drop_before(s.id, s.computed - self.window + 1)
            table = tables.get(s.id)
            while (table is None or len(table) * ps < s.computed + n) and not self.pool.grow(s.id, s.computed + n):
                victims = [v for v in self.running.values() if v.id not in scheduled and v is not s]
                victim = victims[-1] if victims else s
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is s:
                    break
            if s.id not in self.running:
                continue
            work.append(Work(s.id, s.computed, n))
            scheduled.add(s.id)
            budget -= n
            if n == 1:  # counted, and added to the step's shape in one go (64 decodes: one object, not 64)
                dec_n, dec_keys = dec_n + 1, max(dec_keys, s.computed + 1)
            else:
                b.shape = b.shape.with_chunk(s.computed, n)
        b.shape = b.shape.with_decodes(dec_n, dec_keys)
        while self.waiting and not preempted and budget > 0 and b.prefill_left > 0 and \
                len(self.running) + len(self.parked) < self.limits.max_seqs:
            with self._queue_lock:  # the head read is the head popped (an `add(front=True)` may come between)
                s = self.waiting[0]
                if self.pool.pages_for(self.resident(s.total)) > self.pool.free_pages:
                    break  # FCFS: never let a later, smaller request overtake the head
                if self.whole_prompts and min(budget, b.prefill_left) < s.total <= min(
                        self.limits.max_batch_tokens,
                        self.limits.prefill_chunk_tokens or self.limits.max_batch_tokens):
                    break  # it fits a later step whole: start it there rather than split across two
                n = b.timed(0, min(s.total, budget, b.prefill_left))
                if n <= 0:
                    break  # no time left in this step: the head starts in a later one
                self.waiting.popleft()
            b.prefill_left -= n
            b.shape = b.shape.with_chunk(0, n)
            self.pool.grow(s.id, n)
            self.running[s.id] = s
            work.append(Work(s.id, 0, n))
            budget -= n
        self.last_saturated = (budget <= 0 or b.prefill_left <= 0 or b.timed_out) and self._prompt_left(work)
        return Batch(tuple(work), tuple(preempted))

    def _prefilling(self) -> bool:
        """A prompt is queued, or a running sequence has more than a decode's token left."""
        return bool(self.waiting) or any(s.total - s.computed > 1 for s in self.running.values())

    def _prompt_left(self, work: list[Work]) -> bool:
        """Whether prompt tokens wait beyond this step's `work`: a queued prompt, a chunk that does not reach its
        sequence's end, or a running sequence with more than a decode's token left that the step did not take."""
        if self.waiting:
            return True
        took = {w.id: w.n for w in work}
        return any(s.total - s.computed - took[s.id] > 0 if s.id in took else s.total - s.computed > 1
                   for s in self.running.values())

    def advance(self, seq_id: str, n: int, sampled: bool) -> None:
        """`n` more tokens of `seq_id` are cached; `sampled`: a new token was generated."""
        s = self.running.get(seq_id) or self.parked.get(seq_id)
        if s is not None:
            s.computed += n
            if sampled:
                s.total += 1
                s.generated += 1

    def advance_all(self, work: Sequence[Work], sampled: Sequence[bool]) -> None:
        """`advance(w.id, w.n, took)` for every chunk of a step, in one call."""
        running, parked = self.running, self.parked
        for w, took in zip(work, sampled, strict=True):
            s = running.get(w.id) or parked.get(w.id)
            if s is not None:
                s.computed += w.n
                if took:
                    s.total += 1
                    s.generated += 1

    def park(self, seq_id: str) -> None:
        """Out of scheduling until `unpark` (its step's tokens are still on their way back)."""
        s = self.running.pop(seq_id, None)
        if s is not None:
            self.parked[seq_id] = s

    def unpark(self, seq_id: str) -> None:
        s = self.parked.pop(seq_id, None)
        if s is not None:
            self.running[seq_id] = s

    def finish(self, seq_id: str) -> None:
        self.pool.free(seq_id)
        ran = self.running.pop(seq_id, None) is not None
        if self.parked.pop(seq_id, None) is not None or ran:
            return  # never queued at the same time (a preempted sequence leaves `running`)
        with self._queue_lock:  # in place: a rebuilt deque lost what the event loop added to the old one
            for i, s in enumerate(self.waiting):
                if s.id == seq_id:
                    del self.waiting[i]
                    break

    def prefill_room(self) -> int | None:
        """The prompt tokens a chunk would get beside the current decodes and the ones about to join (`joining`):
        the token cap, cut by the step budget as `schedule` cuts it; None unless prefill is capped (not a converted
        decoder). Without the joining ones a burst's first prompts looked to have room on a decoder whose batch the
        same burst was about to fill: it took them, gave them 0-35 tokens a step and handed them back 0.28 s later
        (bench/pd.py). Read from the event loop while the step thread runs: a snapshot."""
        cap, budget_s = self.limits.prefill_chunk_tokens, self.limits.step_budget_s
        if cap is None:
            return None
        dec = [s.computed + 1 for s in list(self.running.values()) if s.total - s.computed <= 1]
        dec += [n + 1 for n in self.joining_prompts()]
        if budget_s is None or self.cost is None or not dec:
            return cap
        fit = self.cost.chunk_fits(budget_s, StepShape(len(dec), max(dec)), 0, cap)
        return cap if fit is None else fit

    def decodes(self) -> int:
        """Sequences decoding now plus those about to join as decodes (`joining`): what a step budget protects.
        A snapshot (read from the event loop while the step thread runs)."""
        running = list(self.running.values())
        return sum(1 for s in running if s.total - s.computed <= 1) + len(self.joining)

    def expect(self, seq_id: str, prompt_len: int) -> None:
        """`seq_id`'s prompt is prefilled elsewhere: it joins as a decode when its KV lands (`joining`)."""
        with self._joining_lock:
            self.joining[seq_id] = prompt_len

    def landed(self, seq_id: str) -> None:
        """`seq_id` no longer joins from elsewhere (its KV landed, or it is prefilled here after all)."""
        with self._joining_lock:
            self.joining.pop(seq_id, None)

    def joining_prompts(self) -> tuple[int, ...]:
        """The prompt lengths in `joining` now, from either thread (a `tuple(joining.values())` is not atomic: see
        the module docstring; 25 of 20,000 such copies raised "dictionary changed size during iteration")."""
        with self._joining_lock:
            return tuple(self.joining.values())

    def known_room(self) -> int | None:
        """`prefill_room` where it is known: a converted decoder's cap alone (no step budget), or cut by a step cost
        that has timed prompt tokens; None otherwise (not converted, or the cut cannot be predicted yet)."""
        if self.limits.prefill_chunk_tokens is None:
            return None
        if self.limits.step_budget_s is not None and (self.cost is None or self.cost.token_s is None):
            return None
        return self.prefill_room()

    def prompts_pending(self) -> bool:
        """Whether a prompt waits to be prefilled (queued, or admitted with prompt tokens not yet computed):
        a step now is one of those the prefill rate is measured over (velocity.VelocityMeter.observe_rate)."""
        queued, running = self.queued(), list(self.running.values())  # the step thread alone changes `running`
        return any([s.computed < s.prompt_len for s in queued]) or any([s.computed < s.prompt_len for s in running])

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.parked
