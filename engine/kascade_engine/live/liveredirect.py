"""Request redirection to a live replica (BlitzScale's redirection, applied to λScale pipelines): a serving
source A hands requests still queued in its scheduler to a live engine H — the head of an execute-while-load
pipeline, or any live or serving replica — that is not its pair (and H may hand its queue to A the same way). H runs
them like its own requests (through
the pipeline) and streams their tokens back; A streams them to its clients under the same request ids.

Why: a pipeline forms seconds into a scale-up. Until then every request queues on the sources, and the router
only steers NEW arrivals to the pipeline (its weight, kascade_router.shares): the queue built before the
pipeline formed drains at the sources' own rate (bench/live.py pipe4: ~64 % of the requests, mean TTFT
1.6-1.8 s, most of it that queue; ADR 0008). Pair redirection (redirect.py) cannot
reach a pipeline: it rides on the pair session, where A finishes the rows; a pipeline's rows finish on its
last receiver, so the tokens are at H, and they must come back to A.

Session (one per A -> H, opened when the operator tells A `cooperate {peer: H's activation port, mode:
redirect}`, on A's PeerPool connection: peerauth first, as every activation connection; `off` ends it):
  A -> H  {"op": "forward"}                         H -> A  {"op": "forwarding", **state}
  A -> H  {"op": "take", "requests": [entry, ...], "queue": A's queue after the pick, "share": A's serving share}
          H -> A  {"op": "taken", "n": entries, "refused": [[req, message]], "declined": [req, ...], **state}
  A -> H  {"op": "abort", "requests": [req, ...]}   (A's client went away)
  A -> H  {"op": "poll"}                            H -> A  {"op": "state", **state}
          H -> A (whenever tokens land)  {"op": "tokens", "events": [[req, token, finished, reason], ...], **state}
          H -> A (H failed a request)    {"op": "ended", "requests": [[req, message]], **state}
  state = {"waiting": H's requests admitted and not started, "share": H's serving share (instance.serving_share)}
  entry = redirect.py's [req, prompt, max_tokens, temperature, top_p, seed, stop_token_ids].
Frames in both directions are independent (one reader per side; sends serialized by a lock).

Which requests (A, in its step thread, between steps: `Forwarder._pick`): from the tail of its queue (those that
would wait longest), only requests with nothing generated, while A's queue after the move, in A's serving share,
is longer than H's in H's: (waiting_A - 1) / share_A > (waiting_H + 1) / share_H, H's queue counted with the
requests in transit to it (an engine steps through `share` replicas' worth of requests per unit of time). Not: a
seeded sampled request (A could not continue its generator if it had to take it back), one taken back before,
or one another engine handed to A (never handed on: no ping-pong), nor one whose client is not A's (a pair's
source hands its live pair requests over the pair session, redirect.py: their tokens must go back that way).
H checks each take against its own queue as it is now (A decided on H's state as A last heard it, and other
sources may have handed theirs meanwhile: four sources deciding at once on the same report sent the head
four times what evened the queues, bench pipe4): it declines what would make its queue the longer one, and A
puts those back at the tail of its queue, in order (they may go later).
Either way: the operator may open sessions both ways (a source -> the pipeline head: the queue the sources built
before the pipeline formed; the head -> each source: the queue the router's weights build on the head, whose
share claims the pipeline's full capacity while its admission lags). `cooperate {mode: redirect}` adds a peer,
`off` ends them all; status `redirect` lists them.
Take-back (never fail): H refused or failed a request, or the session ended, before it finished: A queues
prompt + the tokens streamed so far at the front of its own queue with the tokens still owed, under the same
id (greedy output is unchanged; an unseeded sampled request goes on sampling). Its client sees one stream.

Data flow on A: Serving queue per request (kept) <- `Forwarder._on_tokens` <- H's frames; on H: `take` ->
`Serving.submit` (the pipeline's admission, as an HTTP request) -> `Serving.tokens` -> "tokens" frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kascade_engine.batch import timeline
from kascade_engine.batch.engine import Event
from kascade_engine.batch.sampling import SamplingParams, extras
from kascade_engine.live.redirect import params_from_wire, requeue
from kascade_engine.net.transport import Connection, TransportError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sized

    from kascade_engine.batch.engine import Engine

log = logging.getLogger(__name__)

PICK_EVERY_S = 0.02  # A looks at its queue this often while it has one (between steps, in the step thread)
STATE_MAX_AGE_S = 0.1  # A asks H for its state when the last one it has is older than this and A has a queue
MAX_FRAME = 1 << 20  # a session frame carries prompts and tokens, no tensors


@dataclass
class Forwarded:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)  # tokens streamed to A's client so far


class _Streams(Protocol):
    @property
    def queues(self) -> Mapping[str, object]: ...  # the requests still waited on

    @property
    def wake(self) -> asyncio.Event: ...

    def publish(self, events: list[Event]) -> None: ...

    def submit(self, prompt: list[int], params: SamplingParams, prefill: str | None = None,
               fallback: str | None = None) -> str: ...

    def tokens(self, rid: str) -> AsyncIterator[Event]: ...


class _Held(Protocol):
    @property
    def held(self) -> Sized: ...  # a live pair's requests waiting for their scheduled prefix


class _Counters(Protocol):
    @property
    def redirected(self) -> Any: ...  # prometheus counters

    @property
    def redirect_taken_back(self) -> Any: ...

    @property
    def redirect_received(self) -> Any: ...


class RedirectHost(Protocol):
    """What redirection reads of its engine instance (EngineInstance is one), each time: bind may rebuild the
    engine, and the live pair comes and goes."""

    @property
    def engine(self) -> Engine: ...

    @property
    def serving(self) -> _Streams: ...

    @property
    def serving_share(self) -> float: ...

    @property
    def pair(self) -> _Held | None: ...

    @property
    def forward_host(self) -> ForwardHost: ...

    @property
    def metrics(self) -> _Counters: ...

    def accepting(self) -> None: ...


def _state(inst: RedirectHost) -> dict[str, Any]:
    """H's queue (admitted, not started: the scheduler's and a live pair's held ones) and serving share."""
    held = len(inst.pair.held) if inst.pair is not None else 0
    return {"waiting": len(inst.engine.scheduler.waiting) + held, "share": round(inst.serving_share, 4)}


def forwardable(params: SamplingParams) -> bool:
    """Whether a request may be forwarded: not a seeded sampled one (its take-back could not be exact)."""
    return params.temperature <= 0 or params.seed is None


class Forwarder:
    """The handing side (A): one session to H; requests handed over, by id."""

    def __init__(self, inst: RedirectHost, peer: str, conn: Connection) -> None:
        self.inst, self.peer, self.conn = inst, peer, conn
        self.handed: dict[str, Forwarded] = {}
        self.waiting, self.share = 0, 0.0  # H's last reported state
        self.state_at = 0.0
        self.in_transit = 0  # handed over, not yet acknowledged ("taken") by H
        # the step thread adds to `in_transit` (_pick), the event loop takes from it: a `+=` is a read and a write,
        # and one thread's change landing between the other's lost it for good (H's queue misjudged from then on)
        self._transit_lock = threading.Lock()
        self.total = 0  # metric: requests forwarded
        self.taken_back = 0  # metric: forwarded requests H refused or dropped unfinished, queued here again
        self._kept: set[str] = set()  # taken back: stay here
        self._picking = False
        self._closed = False
        self._send_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop the session runs on

    async def start(self) -> None:
        """Open the session (H's first state), then read H's frames and hand requests over in the background."""
        self.loop = asyncio.get_running_loop()
        await self.conn.send({"op": "forward"})
        reply, _ = await self.conn.recv(timeout=10, max_payload=MAX_FRAME)
        if reply.get("op") != "forwarding":
            raise RuntimeError(f"peer refused the redirect session: {reply.get('message', reply)}")
        self._state(reply)
        self._tasks = [asyncio.create_task(self._read(), name=f"redirect-read-{self.peer}"),
                       asyncio.create_task(self._pump(), name=f"redirect-pump-{self.peer}")]

    def _state(self, frame: dict[str, Any]) -> None:
        w, s = frame.get("waiting"), frame.get("share")
        if isinstance(w, int) and w >= 0:
            self.waiting = w
        if isinstance(s, (int, float)) and s >= 0:
            self.share = float(s)
        self.state_at = time.monotonic()

    async def _send(self, header: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.conn.send(header)

    async def _pump(self) -> None:
        """While A has a queue: keep H's state fresh and look for requests to hand over between steps."""
        eng, loop = self.inst.engine, asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(PICK_EVERY_S)
            if not eng.scheduler.waiting:
                continue
            if time.monotonic() - self.state_at > STATE_MAX_AGE_S:
                try:
                    await self._send({"op": "poll"})
                except TransportError:
                    return
            if not self._picking and self.share > 0:
                self._picking = True
                eng.call_in_step(lambda e: self._pick(e, loop))
                self.inst.serving.wake.set()

    def _pick(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> list[Event]:
        """In A's step thread, between steps: take requests from the tail of the queue (module doc)."""
        try:
            sch, out = engine.scheduler, list[list[Any]]()
            if self._closed:
                return []
            self._kept.intersection_update(engine.requests)
            h_queue, taken = self.waiting + self.in_transit, self.inst.forward_host.taken
            mine, theirs = max(self.inst.serving_share, 1e-6), max(self.share, 1e-6)
            for s in reversed(sch.queued()):  # a snapshot: the event loop may add meanwhile
                if (len(sch.waiting) - 1) / mine <= (h_queue + len(out) + 1) / theirs:
                    break  # the queues are even, in each engine's own serving share
                r = engine.requests.get(s.id)
                if s.generated or r is None or r.out or s.id in self._kept or s.id in taken or \
                        s.id not in self.inst.serving.queues or not forwardable(r.params):
                    # only requests with nothing generated (no KV, no token anywhere), never one twice, and only
                    # our own clients' (a pair's source hands a live engine requests whose client is there: sent on
                    # from here, their tokens reached no one — bench full run, pipe2: one client waited 120 s)
                    continue
                sch.finish(s.id)
                engine.requests.pop(s.id)
                p = r.params
                self.handed[r.id] = Forwarded(r.id, list(r.prompt), p)
                timeline.mark("a-forward", r.id, queue=len(sch.waiting), peer=self.peer)
                out.append([r.id, r.prompt, p.max_tokens, p.temperature, p.top_p, p.seed, list(p.stop_token_ids)]
                           + ([extras(p)] if extras(p) else []))
            if out:
                with self._transit_lock:
                    self.in_transit += len(out)
                q = len(sch.waiting)
                loop.call_soon_threadsafe(lambda: loop.create_task(self._take(out, q, mine)))
        finally:
            self._picking = False
        return []

    async def _take(self, entries: list[list[Any]], queue: int, share: float) -> None:
        try:
            await self._send({"op": "take", "requests": entries, "queue": queue, "share": round(share, 4)})
        except TransportError as e:
            with self._transit_lock:
                self.in_transit -= len(entries)
            for entry in entries:
                self._take_back(str(entry[0]), f"the redirect session to {self.peer} broke: {e}")

    async def _read(self) -> None:
        try:
            while True:
                frame, _ = await self.conn.recv(max_payload=MAX_FRAME)
                self._state(frame)
                op = frame.get("op")
                if op == "taken":
                    n = frame.get("n")
                    n = n if isinstance(n, int) else 0
                    with self._transit_lock:
                        self.in_transit = max(0, self.in_transit - n)
                    refused = [x for x in frame.get("refused") or [] if isinstance(x, list) and len(x) == 2]
                    declined = [str(x) for x in frame.get("declined") or []]
                    for rid in reversed(declined):  # newest first on the wire: back in arrival order
                        self._give_back(rid)
                    for item in refused:
                        self._take_back(str(item[0]), f"{self.peer} refused it: {item[1]}")
                    accepted = max(0, n - len(refused) - len(declined))
                    self.total += accepted
                    self.inst.metrics.redirected.inc(accepted)
                elif op == "tokens":
                    self._on_tokens(frame.get("events") or [])
                elif op == "ended":
                    for item in frame.get("requests") or []:
                        if isinstance(item, list) and len(item) == 2:
                            self._take_back(str(item[0]), f"{self.peer} failed it: {item[1]}")
        except TransportError as e:
            if not self._closed:
                log.warning("redirect session to %s ended: %s", self.peer, e)
        finally:
            self._closed = True
            for rid in list(self.handed):
                self._take_back(rid, f"the redirect session to {self.peer} ended")

    def _on_tokens(self, events: list[Any]) -> None:
        out: list[Event] = []
        for ev in events:
            if not (isinstance(ev, list) and len(ev) == 4 and isinstance(ev[1], int)):
                continue
            rid, tok, finished, reason = str(ev[0]), int(ev[1]), bool(ev[2]), ev[3]
            h = self.handed.get(rid)
            if h is None:  # aborted here meanwhile
                continue
            h.out.append(tok)
            if finished:
                del self.handed[rid]
            out.append(Event(rid, tok, finished, str(reason) if reason is not None else None))
        self.inst.serving.publish(out)

    def _give_back(self, rid: str) -> None:
        """H declined `rid` (its queue had grown as long as ours meanwhile): back to the tail of our queue, where
        it came from; it may be handed over later."""
        h = self.handed.pop(rid, None)
        if h is None or rid not in self.inst.serving.queues:
            return
        self.inst.engine.submit(h.prompt, h.params, h.rid)
        self.inst.serving.wake.set()

    def _take_back(self, rid: str, why: str) -> None:
        """H dropped `rid` unfinished: queue it here again at the front (module doc). On the event loop."""
        h = self.handed.pop(rid, None)
        if h is None or rid not in self.inst.serving.queues:  # finished, or its client went away
            return
        failed = requeue(self.inst.engine, h.rid, h.prompt, h.params, h.out)
        if failed is not None:
            self.inst.serving.publish([Event(h.rid, -1, True, f"error: {why}, and taking it back failed: {failed}")])
            return
        self._kept.add(rid)
        self.taken_back += 1
        self.inst.metrics.redirect_taken_back.inc()
        self.inst.serving.wake.set()
        log.info("took back %s after %d tokens: %s", rid, len(h.out), why)
        timeline.mark("a-took-back", rid, out=len(h.out))

    def abort(self, rid: str) -> None:
        """A's client went away: forget it here and tell H (from any thread)."""
        if self.handed.pop(rid, None) is None:
            return
        loop = self.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._abort(rid)))

    async def _abort(self, rid: str) -> None:
        with contextlib.suppress(TransportError):
            await self._send({"op": "abort", "requests": [rid]})

    async def close(self) -> None:
        """End the session: what H still runs for us comes back here (take-back), then the connection closes."""
        self._closed = True
        await self.conn.close()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, TransportError):
                await t


class ForwardHost:
    """H's side: each session's requests run here as this engine's own (`Serving.submit`)."""

    def __init__(self, inst: RedirectHost) -> None:
        self.inst = inst
        self.sessions = 0  # metric
        self.received = 0  # metric: requests taken from sources
        self.open: set[Connection] = set()  # the sessions' connections (closed with the engine)
        self.taken: set[str] = set()  # this engine's ids of requests it runs for others: never handed on again

    async def handle(self, conn: Connection, first: dict[str, Any]) -> None:
        inst = self.inst
        self.sessions += 1
        lock = asyncio.Lock()
        running: dict[str, asyncio.Task[None]] = {}  # A's request id -> its stream here

        async def send(header: dict[str, Any]) -> None:
            async with lock:
                await conn.send({**header, **_state(inst)})

        async def stream(rid: str, mine: str) -> None:
            try:
                async for ev in inst.serving.tokens(mine):
                    await send({"op": "tokens", "events": [[rid, ev.token, ev.finished, ev.reason]]})
            except TransportError:
                pass  # A is gone: its requests end with the session
            except Exception as e:  # this engine failed it (RequestError): A takes it back
                with contextlib.suppress(TransportError):
                    await send({"op": "ended", "requests": [[rid, str(e)]]})
            finally:
                running.pop(rid, None)
                self.taken.discard(mine)

        self.open.add(conn)
        try:
            await send({"op": "forwarding"})
            while True:
                frame, _ = await conn.recv(max_payload=MAX_FRAME)
                op = frame.get("op")
                if op == "take":
                    refused: list[list[str]] = []
                    declined: list[str] = []
                    entries = frame.get("requests")
                    entries = entries if isinstance(entries, list) else []
                    q_a, share_a = frame.get("queue"), frame.get("share")
                    for i, entry in enumerate(entries):
                        try:
                            rid, prompt, params = params_from_wire(entry)
                        except ValueError as e:
                            refused.append([str(entry[0]) if isinstance(entry, list) and entry else "?", str(e)])
                            continue
                        # the sender decided on our state as it last heard it, and other engines may have handed
                        # us theirs meanwhile: take it only while the sender's queue with it stays the longer one
                        if isinstance(q_a, int) and isinstance(share_a, (int, float)) and share_a > 0:
                            st = _state(inst)
                            if (q_a + len(entries) - i - 1) / share_a <= (st["waiting"] + 1) / max(st["share"], 1e-6):
                                declined.append(rid)
                                continue
                        try:
                            inst.accepting()
                            mine = inst.serving.submit(prompt, params)
                        except Exception as e:  # not servable any more, or the request does not fit here
                            refused.append([rid, str(getattr(e, "message", e))])
                            continue
                        self.taken.add(mine)
                        self.received += 1
                        inst.metrics.redirect_received.inc()
                        timeline.mark("h-took", mine, source_request=rid)
                        running[rid] = asyncio.create_task(stream(rid, mine))
                    await send({"op": "taken", "n": len(entries), "refused": refused, "declined": declined})
                elif op == "abort":
                    for rid in frame.get("requests") or []:
                        t = running.get(str(rid))
                        if t is not None:
                            t.cancel()  # leaving Serving.tokens early aborts the request here
                elif op == "poll":
                    await send({"op": "state"})
                else:
                    await send({"op": "error", "message": f"unknown op {op!r} in a redirect session"})
        except TransportError:
            return
        finally:
            self.open.discard(conn)
            for t in list(running.values()):
                t.cancel()

    async def close(self) -> None:
        """This engine goes away: its sessions end (the sources take back what ran here unfinished)."""
        for conn in list(self.open):
            with contextlib.suppress(TransportError):
                await conn.close()
