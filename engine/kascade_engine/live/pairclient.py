"""PairClient: the loading engine B's side of a live pair (the frames are in cooperation.py). B runs the
resident prefix of every sequence in its batch and sends the step to A in one activation frame; up to
PIPELINE_DEPTH steps are out at once (B computes the next step's prefix while A runs the last one), the
sequences of a step out parked in B's scheduler until A's tokens land. Once every layer is here, split
sequences are taken over whole (migration.py). Requests A hands over (redirect.py) run here and finish
on A. With a ZigZag policy (livepolicy.py), admission waits for each batch's scheduled prefix.

Data flow: Engine.step -> `prepare` (park sequences to migrate) -> schedule -> `forward` (prefix, frame
out, land answers that are back) -> tokens now for local rows, later through `take_events`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kascade_engine.batch import timeline
from kascade_engine.batch.emulation import pace
from kascade_engine.batch.engine import Event
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import pick
from kascade_engine.live import migration
from kascade_engine.live.cooperation import Row, own_rows, staggered
from kascade_engine.live.livepolicy import ZigZagPolicy, hold_until
from kascade_engine.live.redirect import params_from_wire
from kascade_engine.net.transport import Connection

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine, StepHooks
    from kascade_engine.batch.scheduler import Work

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 4  # B's steps out on A at once: B computes the next steps' prefixes while A runs the last ones
# A pipeline head's steps out per receiver: a round trip crosses every receiver (each hop's wait, step and link),
# while the head steps through its stage alone, so with PIPELINE_DEPTH out it waited for answers (bench pipe4
# r8, a 1-layer stage: 4 frames out, then ~0.8 s for the oldest answer; 3 new prompts per frame).
PIPELINE_DEPTH_PER_RECEIVER = 4
IDLE_WAIT_S = 0.005  # with nothing else to run, B checks for new requests this often while a step is out
# How long B waits for A's answer to a step, derived from what it measured: STEP_DEADLINE_FACTOR x the slowest of
# the last STEP_WINDOW answers, at least STEP_DEADLINE_FLOOR_S, at most the pair's timeout (120 s, what it waited
# on a hung peer before: every request on the pair stalled that long). Past it the step's requests fail.
STEP_DEADLINE_FLOOR_S = 10.0
STEP_DEADLINE_FACTOR = 10.0
STEP_WINDOW = 32


@dataclass
class OutStep:
    """One of B's steps out on A: its rows (request, whether it samples) in frame order, and the answer."""

    rows: list[tuple[str, bool]]
    fut: Future[tuple[dict[str, Any], bytearray]]
    moving: list[str] = field(default_factory=list)  # sequences asked for whole (migration.py), parked
    step: int = 0  # B's step it belongs to (a step goes out as one frame per split layer)
    asked: bool = True  # it carried the step's queue (`waiting`): its answer says whether A has one


class PairClient:
    """B's hook: the pair's one connection, and each of B's sequences' split point."""

    def __init__(self, model: LlamaModel, conn: Connection, loop: asyncio.AbstractEventLoop,
                 timeout: float = 120.0) -> None:
        self.model, self.conn, self.loop, self.timeout = model, conn, loop, timeout
        self.split: dict[str, int] = {}  # request -> k (its layers on B)
        self.want: dict[str, int] = {}  # request -> k chosen by the ZigZag policy at admission
        self.policy: ZigZagPolicy | None = None  # None: best effort (k = the resident prefix)
        self.peer_complete = True  # the peer holds the whole model (a source); False: a pipeline's next receiver
        self.peer_receivers = 0  # loading engines from the peer on that run our rows' later layers (a pipeline)
        # a pipeline head's stage: the layers it runs of each new sequence, fixed when the pipeline formed: its
        # resident prefix, or less where the next receiver's layers begin (layers both hold run there). Layers
        # landing here later do not lengthen its steps: the head admits every new request, so its step time
        # bounds the whole pipeline's admission (bench pipe4: with k = the growing prefix its steps grew to
        # 0.65 s, 3 new prompts each). None: a pair with a source (k = the resident prefix, or ZigZag's).
        self.stage: int | None = None
        self.peer_first: int | None = None  # the lowest layer the peer holds (its paired reply)
        self.depth = PIPELINE_DEPTH  # steps out at once; a pipeline head: PIPELINE_DEPTH_PER_RECEIVER per receiver
        self.remote: set[str] = set()  # requests A holds KV for
        self.held: set[asyncio.Task[None]] = set()  # requests waiting for their scheduled prefix
        # request -> prompt tokens, admitted here and not yet started (held or in the scheduler's queue), FCFS:
        # the queue ZigZag re-plans from at each admission (livepolicy.py). Event loop adds, step thread drops.
        self.ahead: dict[str, int] = {}
        self.holding: set[str] = set()  # of `ahead`: held for their prefix (not yet in the engine)
        self._ahead_lock = threading.Lock()
        self.fallback: StepHooks | None = None  # the engine's hook once nothing runs split any more
        self.history: list[tuple[str, int]] = []  # (request, k) as each sequence started: the split point
        self.admitted_ids: list[str] = []  # admission order while loading
        self.steps_sent = 0  # frames sent
        self.steps_stepped = 0  # B steps sent (each as one frame per split layer)
        self.layer_s = 0.0  # emulated seconds per layer forward (benchmarks; 0: off)
        self.knee_tokens = 0  # emulation: tokens per layer forward before it costs more (0: never)
        self.bytes_sent = 0
        self.tokens_sent = 0
        self.redirected: set[str] = set()  # requests A handed to us (redirect.py): always finished on A
        self.refused: list[list[str]] = []  # [[req, message]] of handed requests we could not run
        self.peer_queued = True  # poll A (an empty step) while it reports queued requests; once at pair time
        self.received = 0  # metric: requests A handed to us
        self.seen = 0  # redirect entries read from A's answers (refused ones too): sent back as "seen"
        self.inflight: deque[OutStep] = deque()  # our steps out on A, oldest first
        self.max_inflight = 0  # metric: most steps out at once (PIPELINE_DEPTH when B keeps A busy)
        self.migrated = 0  # metric: split sequences taken over whole once every layer was here
        self.moving: list[list[Any]] = []  # [[req, k]] parked by `prepare`, asked for in the next frame
        self.stay_split: set[str] = set()  # sequences the pair could not hand over: they finish split
        self.events: list[Event] = []  # tokens of our requests that landed (Engine.step emits them)
        # routes events to their requests from inside a step (serving.Serving.publish); None: at the step's end
        self.emit: Callable[[list[Event]], None] | None = None
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self.answer_s: deque[float] = deque(maxlen=STEP_WINDOW)  # A's recent answer times (each after the last)

    def step_deadline(self) -> float:
        """Seconds to wait for A's next answer (see STEP_DEADLINE_FLOOR_S)."""
        measured = STEP_DEADLINE_FACTOR * max(self.answer_s, default=0.0)
        return min(self.timeout, max(STEP_DEADLINE_FLOOR_S, measured))

    def pending(self) -> bool:
        # poll A while it reports a queue; keep stepping while a step is out (its answer delivers tokens)
        return self.peer_queued or bool(self.inflight) or bool(self.moving)

    def abort(self, rid: str) -> None:
        pass  # our own requests: their end rides on the next step

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    async def _exchange(self, header: dict[str, Any], raw: bytes) -> tuple[dict[str, Any], bytearray]:
        # Two steps can be out at once on the one connection: sends go out whole and in order, and the
        # answers (A serves a pair's steps in order) are read in the same order. asyncio.Lock is FIFO.
        async with self._send_lock:
            await self.conn.send(header, raw)
        async with self._recv_lock:  # A answers in order: from here it owes this step's answer within one step
            t0 = time.monotonic()
            reply, payload = await self.conn.recv(timeout=self.step_deadline(),
                                                  max_payload=2 * migration.MIGRATE_BYTES)
            self.answer_s.append(time.monotonic() - t0)
        return reply, payload

    def forward(self, engine: Engine, work: list[Work]) -> list[int | None]:
        m, L = self.model, self.model.shape.layers
        for rid in [r for r in self.split if r not in engine.requests]:  # finished or aborted
            self.split.pop(rid)
        self.redirected.intersection_update(engine.requests)  # handed requests finished or aborted here
        out_now = {rid for f in self.inflight for rid, _ in f.rows}
        with self._ahead_lock:  # started now, or gone (aborted) before it started
            for rid in [r for r in self.ahead if r not in self.holding and r not in engine.requests]:
                self.ahead.pop(rid)
            for w in work:
                self.ahead.pop(w.id, None)
        ends = [r for r in self.remote if r not in self.split and r not in out_now]  # A frees them
        self.remote.difference_update(ends)
        for w in work:
            if w.id not in self.split:
                want = self.want.pop(w.id, None)
                k = m.resident_prefix() if self.stage is None else min(self.stage, m.resident_prefix())
                whole = m.complete and not self._pipelining_backlog(engine)
                self.split[w.id] = L if whole else want if want is not None else k
                timeline.mark("b-start", w.id, k=self.split[w.id])
                self.history.append((w.id, self.split[w.id]))
        rows, sampling = own_rows(engine, work, lambda rid: self.split[rid])
        t0 = time.perf_counter()
        self._pace_landing(engine, t0, staggered(m, engine.cache, rows, self.knee_tokens,
                                                         run=engine.run_rows))
        local = [
            i for i in sampling if self.split[work[i].id] == L and m.complete and work[i].id not in self.redirected
        ]
        far = [i for i, w in enumerate(work) if not (self.split[w.id] == L and m.complete) or w.id in self.redirected]
        toks: dict[int, int | None] = {i: None for i in sampling}  # None: out on A, delivered when it lands
        if local:
            logits = m.logits(torch.cat([rows[i].x[-1:] for i in local]))
            for i, tok in zip(
                local, pick(logits, [engine.requests[work[i].id] for i in local], engine.eos), strict=True
            ):
                toks[i] = tok
        move, self.moving = self.moving, []
        if far or ends or move or self.refused or (self.peer_queued and not self.inflight):
            self._send(engine, work, rows, far, set(sampling), ends, move)
        # Pipelined (depth PIPELINE_DEPTH, a pipeline head more): B runs its next batch's prefix while A finishes the
        # last one, so
        # B's step rate follows A's, not A's plus B's. Wait only when the pipe is full or B has nothing else.
        while self._steps_out() >= self.depth:
            self._land(engine, self.inflight.popleft())
        if not work and self.inflight:  # nothing to run: wait for the answer, but only briefly, so a request
            wait([self.inflight[0].fut], timeout=IDLE_WAIT_S)  # arriving meanwhile goes out as the next step
        while self.inflight and self.inflight[0].fut.done():
            self._land(engine, self.inflight.popleft())
        # fully loaded, no split sequence left and nothing A handed us still here (one still queued would
        # otherwise run as ours and its tokens never reach A's client): a plain engine again
        # (unless the event loop replaced this pair meanwhile: that one stays)
        if m.complete and not self.remote and not self.redirected and not self.inflight and \
                all(k == L for k in self.split.values()) and engine.step_down(self, self.fallback):
            engine.scheduler.whole_prompts = False  # alone again: chunked prefill as usual
        return [toks[i] for i in sampling]

    def _pace_landing(self, engine: Engine, t0: float, layers: float) -> None:
        """`pace` this step's prefix (emulated accelerator), landing A's answers that come back meanwhile:
        their tokens reach the clients now (`emit`), not when this step ends — a step here can take up to
        L - 1 layer times, and an answer that waited for it (bench: up to 540 ms) delayed that token and
        kept its sequence parked."""
        end = t0 + layers * self.layer_s
        while self.inflight:
            while self.inflight and self.inflight[0].fut.done():
                self._land(engine, self.inflight.popleft())
            if self.emit is not None and self.events:
                out, self.events = self.events, []
                self.emit(out)
            left = end - time.perf_counter()
            if left <= 0 or not self.inflight:
                break
            wait([self.inflight[0].fut], timeout=left)
        pace(t0, layers, self.layer_s)

    def _pipelining_backlog(self, engine: Engine) -> bool:
        """A complete pipeline head with requests still queued keeps starting them at its stage: its stage
        steps admit L / stage times as often as whole-model steps, and the queue it has was routed to it at
        the pipeline's rate (instance.serving_share). Once the queue is gone, new sequences run whole here."""
        return self.stage is not None and bool(engine.scheduler.waiting)

    def prepare(self, engine: Engine) -> None:
        """Before the schedule: once every layer is here, park split sequences to take over whole (migration.py;
        asked in this step's frame): none with a step out, none A's client waits for (redirected), within the
        frame's byte budget."""
        if not self.model.complete or self.moving or any(f.moving for f in self.inflight) or \
                self._pipelining_backlog(engine):  # (its new split sequences would move back at once)
            return
        L, size = self.model.shape.layers, 0
        move: list[list[Any]] = []
        for rid, k in self.split.items():
            s = engine.scheduler.running.get(rid)
            if k >= L or s is None or rid in self.redirected or rid in self.stay_split:
                continue
            size += migration.engine_kv_bytes(engine, L - k, s.computed)
            if move and size > migration.MIGRATE_BYTES:
                break
            move.append([rid, k])
            engine.scheduler.park(rid)  # nothing of it runs until its state lands
        self.moving = move

    def _send(self, engine: Engine, work: list[Work], rows: list[Row], far: list[int], sampling: set[int],
              ends: list[str], move: list[list[Any]]) -> None:
        """The step's rows out to the peer: one frame per split layer k, the highest k first. A frame joins
        the peer's running forward only if it has not passed the frame's lowest k (cooperation.staggered), and
        answers come back in frame order; so a new prompt's rows (the resident prefix, high k) do not wait
        for the decode rows of sequences started earlier with a low k (bench: such a mixed frame missed the
        running step and the prompt's first token waited a whole step more). The step's other fields
        (ends, queue, refusals, migration) ride in the last frame, as one frame carried them before."""
        groups: dict[int, list[int]] = {}
        for i in far:
            groups.setdefault(self.split[work[i].id], []).append(i)
        order = sorted(groups, reverse=True) or [0]
        step = self.steps_stepped
        self.steps_stepped += 1
        for n, k in enumerate(order):
            last = n == len(order) - 1
            part = groups.get(k, [])
            meta: list[list[Any]] = []
            for i in part:
                w, p = work[i], engine.requests[work[i].id].params
                meta.append([w.id, w.start, w.n, self.split[w.id], i in sampling, p.temperature, p.top_p, p.seed])
                self.remote.add(w.id)
                if w.start == 0:
                    timeline.mark("b-sent", w.id, step=self.steps_sent, rows=len(part))
                engine.scheduler.park(w.id)  # not scheduled again until A's answer for this step lands
            hidden = torch.cat([rows[i].x for i in part]) if part else torch.empty(0, self.model.shape.hidden)
            extra: dict[str, Any] = {}
            asks = last and self.model.resident("embed")  # no requests handed over before their first block is here
            if last:
                refused, self.refused = self.refused, []
                extra = {"refused": refused, "seen": self.seen, **({"migrate": move} if move else {}),
                         **({"waiting": len(engine.scheduler.waiting) + len(self.held)} if asks else {})}
            fut = self._submit(meta, hidden, ends if last else [], extra)
            self.inflight.append(OutStep([(work[i].id, i in sampling) for i in part], fut,
                                         [str(x[0]) for x in move] if last else [], step, asks))
        self.max_inflight = max(self.max_inflight, self._steps_out())

    def _steps_out(self) -> int:
        return len({f.step for f in self.inflight})

    def _land(self, engine: Engine, step: OutStep) -> None:
        """A's answer to one of our steps: tokens to their requests (unparked), then its redirect fields."""
        try:
            ready = step.fut.done()
            reply, payload = step.fut.result(self.timeout + 5)
            timeline.mark("b-land", "-", rows=len(step.rows), was_ready=ready)
            if reply.get("op") != "tokens":
                raise RuntimeError(f"pair refused the step: {reply.get('message', reply)}")
            toks = iter(int(t) for t in reply["tokens"])
            got = [(rid, next(toks) if sampled else None) for rid, sampled in step.rows]
        except Exception as e:  # any failure of the step fails exactly its requests
            log.warning("pair step failed for %d requests: %s", len(step.rows), e)
            for rid in [r for r, _ in step.rows] + step.moving:
                if rid in engine.requests:
                    engine.scheduler.finish(rid)
                    engine.requests.pop(rid, None)
                    # (the rows' later layers' KV is on the peer: the request cannot go on without it)
                    self.events.append(Event(rid, -1, True, f"error: live pair step failed: {e}"))
            self.peer_queued = False
            return
        now = time.monotonic()
        for rid, tok in got:
            if rid not in engine.requests:  # aborted while its step was out
                continue
            engine.scheduler.unpark(rid)
            if tok is not None:
                if not engine.requests[rid].out:
                    timeline.mark("b-token", rid)
                engine.scheduler.advance(rid, 0, True)
                self.events.append(engine.deliver(rid, tok, now))
        self._take_over(engine, step, reply.get("migrated") or [], memoryview(payload))
        self._take_redirects(engine, reply, step.asked)

    def _take_over(self, engine: Engine, step: OutStep, moved: list[Any], payload: memoryview) -> None:
        """A's answer to our migrate list: each sequence's K/V for its layers there, written into our pages;
        from now on it runs here whole. A sequence A could not hand over stays split."""
        at, L = 0, self.model.shape.layers
        for item in moved:
            rid, k, n, err, state = (
                item if isinstance(item, list) and len(item) == 5 else ("?", 0, 0, "bad entry", None)
            )
            size = migration.engine_kv_bytes(engine, L - int(k), int(n)) if not err else 0
            chunk, at = payload[at:at + size], at + size
            s = engine.scheduler.parked.get(str(rid))
            if err:
                log.warning("migration of %s refused by the pair: %s (it stays split)", rid, err)
                self.stay_split.add(str(rid))
            elif s is None:  # aborted while moving: A freed it anyway
                self.remote.discard(str(rid))
            else:
                try:
                    if s.computed != n or self.split.get(str(rid)) != k:
                        raise ValueError(f"the pair held {n} positions from layer {k}, this engine "
                                         f"{s.computed} from {self.split.get(str(rid))}")
                    migration.put_into(engine, engine.scheduler.pool.tables[str(rid)], int(k), int(n), chunk)
                    migration.set_gen_state(engine.requests[str(rid)].gen, state)
                except (ValueError, RuntimeError, TypeError) as e:  # A freed it: the request cannot go on
                    log.warning("migration of %s failed: %s", rid, e)
                    engine.scheduler.finish(str(rid))
                    engine.requests.pop(str(rid), None)
                    self.events.append(Event(str(rid), -1, True, f"error: decode-state migration failed: {e}"))
                    continue
                self.split[str(rid)] = L
                self.remote.discard(str(rid))  # A freed its pages
                self.migrated += 1
        for rid in step.moving:
            engine.scheduler.unpark(rid)

    def _take_redirects(self, engine: Engine, reply: dict[str, Any], asked: bool) -> None:
        """A's answer may hand us queued requests (run like ours, finished on A) and abort some of them."""
        if asked:  # the frame that carried our queue: A's answer says whether A has one (absent: it has none)
            self.peer_queued = bool(reply.get("queued"))
        for rid in reply.get("abort") or []:
            if str(rid) in self.redirected:
                engine.abort(str(rid))
        for entry in reply.get("redirect") or []:
            self.seen += 1
            try:
                rid, prompt, params = params_from_wire(entry)
                engine.submit(prompt, params, rid)
            except ValueError as e:
                self.refused.append([str(entry[0]) if isinstance(entry, list) and entry else "?", str(e)])
                continue
            self.redirected.add(rid)
            self.received += 1
            timeline.mark("b-took", rid)

    def _submit(self, meta: list[list[Any]], hidden: torch.Tensor, ends: list[str],
                extra: dict[str, Any] | None = None) -> Future[tuple[dict[str, Any], bytearray]]:
        """One step frame to the peer (from the engine's worker thread), sent in order; its answer's future."""
        name = str(hidden.dtype).removeprefix("torch.")
        raw = hidden.contiguous().cpu().view(torch.uint8).numpy().tobytes() if hidden.numel() else b""
        header = {"op": "step", "rows": meta, "end": ends, "shape": list(hidden.shape), "dtype": name, **(extra or {})}
        if timeline.on():  # the step's number, for the timeline only (A logs it as it joins a batch)
            header["seq"] = self.steps_sent
            timeline.mark("b-step", "-", seq=self.steps_sent, rows=len(meta), tokens=int(hidden.shape[0]))
        fut = asyncio.run_coroutine_threadsafe(self._exchange(header, raw), self.loop)  # -> (answer, payload)
        self.steps_sent += 1
        self.bytes_sent += len(raw)
        self.tokens_sent += int(hidden.shape[0])
        return fut

    def relay_async(self, meta: list[list[Any]], hidden: torch.Tensor,
                    ends: list[str]) -> Future[tuple[dict[str, Any], bytearray]]:
        """A pipeline hop's rows on to the next receiver, one frame; the answer's future (not waited for: the
        hop's next step runs meanwhile). Frames and answers keep their order on the one connection."""
        return self._submit(meta, hidden, ends)

    def admit(self, rid: str, submit: Callable[[], None], fail: Callable[[Exception], None], tokens: int = 1) -> None:
        """Submit `rid` to this engine's batch now, or once its `embed` block is resident (every row starts
        there: a step of a row without it fails), or (ZigZag) once its scheduled prefix is resident."""
        self.admitted_ids.append(rid)
        if self.model.complete or (self.policy is None and self.model.resident("embed")):
            submit()
            return
        if self.policy is None:
            self._hold(rid, None, submit, fail)
            return
        with self._ahead_lock:
            queued_tokens, queued = sum(self.ahead.values()), len(self.ahead)
            self.ahead[rid] = tokens
            self.holding.add(rid)  # until it is in the engine: the step thread must not drop it as gone
        k = self.policy.next_target(self.model.resident_prefix(), tokens, queued_tokens, queued)
        self.want[rid] = k
        timeline.mark("b-plan", rid, k=k, resident=self.model.resident_prefix(), queued=queued)
        if self.model.resident_prefix() >= k and self.model.resident("embed"):
            try:
                submit()
            finally:
                self.holding.discard(rid)
            return
        self._hold(rid, k, submit, fail)

    def _embedded(self) -> int:
        return int(self.model.resident("embed"))

    def _hold(self, rid: str, k: int | None, submit: Callable[[], None], fail: Callable[[Exception], None]) -> None:
        """Submit `rid` once `embed` (and, ZigZag, `k` layers) is resident; a load that stalls without embed
        fails it (nothing of it can run here), one that stalls short of `k` runs it with what is resident."""

        async def later() -> None:
            try:
                if not await hold_until(self._embedded, 1):
                    fail(RuntimeError("block embed is not resident: the load stalled before it landed"))
                    return
                if k is not None:
                    if not await hold_until(self.model.resident_prefix, k):  # the load stalled: best effort instead
                        log.warning("request %s: %d layers not resident in time; runs with the %d resident",
                                    rid, k, self.model.resident_prefix())
                        self.want[rid] = self.model.resident_prefix()
                    timeline.mark("b-release", rid, k=self.want[rid])
                try:
                    submit()
                except Exception as e:
                    fail(e)
            finally:
                self.holding.discard(rid)

        self.held.add(t := self.loop.create_task(later()))
        t.add_done_callback(self.held.discard)

    async def close(self) -> None:
        for t in list(self.held):
            t.cancel()
        await self.conn.close()
