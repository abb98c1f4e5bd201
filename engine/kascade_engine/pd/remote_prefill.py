"""Remote prefill: the decode engine's side of disaggregated serving. A request that arrives with a prefill
peer (the router's `X-Kascade-Prefill: host:port`, the prefill engine's data port) is prefilled there; its
KV lands here layer by layer, and the sequence joins this engine's batch as a running decode.

Data flow: `Serving.submit(..., prefill=peer)` -> `RemotePrefill.start` (a task) -> an authenticated
data-plane connection from `PeerPool` over the engine's `--transport` (`EngineInstance.transport`: tcp,
tcp with mutual TLS, or ucx; the same frames and checks on each) (hello; reused across requests) -> {"op": "prefill"}
-> every kv
frame is checked (kv_wire.py) and received straight into a host staging tensor [layers, prompt, kv_heads,
head_dim] (K and V) -> kv_done: coverage, byte count and digest verified -> `Engine.call_in_step(adopt)`:
in the step thread, pages are allocated, the staged KV is copied into them (Engine.write_kv: a tensor-parallel
instance's rank 0 scatters every rank its KV heads, tp/kv.py), and the sequence enters the
scheduler with its prompt computed and its first token known; that token is the request's first Event.
Anything that goes wrong before adoption (peer unreachable, refused, a bad frame, a digest mismatch)
falls back to a local prefill of the same request: PD never fails a request, it only moves work.
A peer that is a converted decoder may hand the prompt back ({"op": "handback"}: its budget leaves the prompt no
progress, handback.py): it then goes to the `fallback` prefill engine the router named (queued there by its
arrival here), or is prefilled here without one.
Who prefills a prompt that may be handed back is settled as soon as it is known (`Serving.decide`, the answer's
HANDED_BACK_HEADER): when a hand-back's prefill op went out to its prefill engine (`settles`), or when it is to be
prefilled here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kascade_engine.batch.engine import Event, Request
from kascade_engine.batch.sampling import SamplingParams, extras, stops_here
from kascade_engine.batch.scheduler import Seq
from kascade_engine.net.peerpool import PeerPool
from kascade_engine.net.transport import Connection, TransportError
from kascade_engine.pd.deadline import PrefillDeadline
from kascade_engine.pd.kv_wire import Coverage, KVWireError, PrefillOp, check_kv, digest, pace
from kascade_engine.pd.prefill_server import KVHost, host_bytes, kv_shape
from kascade_planner.conversion import remote_prefill_s

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.net.transport import Transport
    from kascade_engine.pd.metrics import PDMetrics

log = logging.getLogger(__name__)
# weight of the newest remote prefill in `RemotePrefill.took`: follows a burst's growing queue within a few prompts
TOOK_WEIGHT = 0.3


class RemotePrefillError(Exception):
    pass


class HandedBack(RemotePrefillError):
    """The peer (a converted decoder) gave the prompt back: its budget leaves it no progress (handback.py)."""


class _Streams(Protocol):
    @property
    def queues(self) -> Mapping[str, object]: ...  # the requests still waited on

    @property
    def wake(self) -> asyncio.Event: ...

    def decide(self, rid: str, by: str | None) -> None: ...


class _Token(Protocol):
    @property
    def token(self) -> str: ...


class RemotePrefillHost(KVHost, Protocol):
    """What remote prefill reads of its engine instance (EngineInstance is one), each time: bind may rebuild the
    engine and model for another dtype."""

    @property
    def transport(self) -> Transport: ...

    @property
    def config(self) -> _Token: ...

    @property
    def serving(self) -> _Streams: ...

    @property
    def pd_metrics(self) -> PDMetrics: ...


class RemotePrefill:
    def __init__(self, inst: RemotePrefillHost) -> None:
        self.inst = inst
        self.pool = PeerPool(inst.transport, inst.config.token)  # the engine's data-port transport (tcp, tls, ucx)
        self.adopted = 0  # metrics: requests whose prefill ran on a peer
        self.fallbacks = 0  # requests prefilled here after a remote prefill failed
        self.handed_back = 0  # prompts a peer (a converted decoder) handed back, prefilled on the fallback or here
        self.bytes_received = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.link: dict[str, float] = {}  # peer -> KV bytes/s of its last transfer (network velocity)
        # peer -> seconds a remote prefill on it takes now, start to KV landed (its queue, compute and link),
        # a moving average over recent prompts: what the hand-back compares a slow local prefill with
        self.took: dict[str, float] = {}
        # rid -> (peer, start, prompt tokens) of remote prefills in flight: the queue this engine put ahead of a
        # prompt it sends `peer` now (expected_s)
        self.pending: dict[str, tuple[str, float, int]] = {}
        # peer -> its measured prefill rate, prompt tokens/s, from its last kv_done (kv_wire.pace): how fast it works
        # through that queue
        self.pace: dict[str, float] = {}
        # changed on the event loop, copied by `expected_s` in the step thread too (the hand-back's check): every change
        # and copy holds it (a `tuple(d.values())` is not atomic: batch/scheduler.py's module docstring)
        self._pending_lock = threading.Lock()
        # how long a connection to a peer and each of its KV frames may take before the prompt is prefilled here
        self.deadline = PrefillDeadline()
        self.suspects: dict[str, float] = {}  # peer -> monotonic time until which it gets no prompts (it hung)

    def suspect_s(self, peer: str) -> float:
        """Seconds `peer` stays suspect (0: it is not): it missed a deadline, prompts for it are prefilled here."""
        left = self.suspects.get(peer, 0.0) - time.monotonic()
        if left <= 0:
            self.suspects.pop(peer, None)
            return 0.0
        return left

    def _suspect(self, peer: str) -> None:
        """`peer` hung: no prompts for a while, and its pooled connections (likely as hung) are closed."""
        self.suspects[peer] = time.monotonic() + self.deadline.suspect_for_s
        for conn in self.pool.idle.pop(peer, []):
            self._give_back(peer, conn, False)

    def start(self, rid: str, prompt: list[int], params: SamplingParams, peer: str,
              local: Callable[[], None], arrived: float | None = None, fallback: str | None = None,
              settles: bool = False) -> None:
        """Prefill `rid` on `peer`; `local()` submits it here instead (called on the event loop). `arrived`
        (this engine's monotonic clock; None: now): when the prompt arrived here, so the peer queues it by
        the time it already waited (a handed-back prompt, handback.py). `fallback`: where the prompt goes if
        `peer` (a converted decoder) hands it back; None: it is prefilled here then. `settles`: `peer` is where a
        hand-back sends it (it will not hand it back again): once the prefill op is sent, `peer` prefills it."""
        # in flight from now, not from when the task first runs: a prompt judged right after this one (the same tick)
        # sees it queued ahead at `peer` (expected_s)
        with self._pending_lock:
            self.pending[rid] = (peer, time.monotonic(), len(prompt))
        # it joins the batch as a decode when its KV lands: the scheduler's prefill room counts it until then
        self.inst.engine.scheduler.expect(rid, len(prompt))
        task = asyncio.get_running_loop().create_task(
            self._run(rid, prompt, params, peer, local, arrived, fallback, settles))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, rid: str, prompt: list[int], params: SamplingParams, peer: str,
                   local: Callable[[], None], arrived: float | None = None, fallback: str | None = None,
                   settles: bool = False) -> None:
        mine = self.pending[rid]
        t0 = mine[1]
        serving = self.inst.serving

        def here() -> None:  # prefilled here after all: settled now, not at its first token
            serving.decide(rid, None)
            local()

        try:
            token, k, v = await self._fetch(rid, prompt, params, peer, arrived, fallback, settles)
        except HandedBack as e:  # not a failure of the peer: it declined the prompt by the hand-back rule
            self.handed_back += 1
            log.info("request %s: %s handed it back (%s); prefilling it on %s", rid, peer, e, fallback or "this engine")
            if rid not in self.inst.serving.queues:
                return
            if fallback is not None and fallback != peer:  # queued there by its arrival here
                self.start(rid, prompt, params, fallback, local, t0 if arrived is None else arrived, settles=True)
            else:
                here()
            return
        except (RemotePrefillError, KVWireError, TransportError, OSError, RuntimeError, ValueError, TimeoutError) as e:
            self.fallbacks += 1
            self.inst.pd_metrics.fallbacks.inc()
            log.warning("request %s: remote prefill on %s failed (%s); prefilling locally", rid, peer, e)
            if rid in self.inst.serving.queues:
                here()
            return
        finally:
            with self._pending_lock:
                ended = self.pending.get(rid) is mine  # not a hand-back's next remote prefill, started above
                if ended:
                    del self.pending[rid]
            if ended:
                self.inst.engine.scheduler.landed(rid)
        dt = time.monotonic() - t0
        old = self.took.get(peer)
        self.took[peer] = dt if old is None else old + TOOK_WEIGHT * (dt - old)
        if rid not in self.inst.serving.queues:  # the client went away while the KV moved
            return
        self.inst.engine.call_in_step(lambda eng: self._adopt(eng, rid, prompt, params, token, k, v, peer))
        self.inst.serving.wake.set()

    def expected_s(self, peer: str, prompt_tokens: int = 0, without: str | None = None) -> float | None:
        """What a prompt of `prompt_tokens` sent to `peer` now takes there (`conversion.remote_prefill_s`): the oldest
        wait of this engine's prompts in flight there plus their prompt tokens and this one's at `peer`'s reported
        pace (its kv_done's rate), never less than the moving average of those that landed (`took`). What it counts
        is what this engine sent `peer` and has not got back; it cannot see the prompts other decode engines queued
        there, except through the oldest wait (they delay its prompts too). Without a reported pace: the average or
        the oldest wait, whichever is longer (a burst's queue grows before any of it lands: the average of the prompts
        before the burst said 0.3 s while P's queue held 1-2 s, bench/pd.py). None: nothing
        measured yet."""
        now = time.monotonic()
        with self._pending_lock:
            mine = [(now - t, n) for r, (p, t, n) in self.pending.items() if p == peer and r != without]
        return remote_prefill_s(self.took.get(peer), [w for w, _ in mine], sum(n for _, n in mine) + prompt_tokens,
                                self.pace.get(peer))

    async def _fetch(self, rid: str, prompt: list[int], params: SamplingParams, peer: str,
                     arrived: float | None = None, fallback: str | None = None,
                     settles: bool = False) -> tuple[int, torch.Tensor, torch.Tensor]:
        shape = kv_shape(self.inst)
        if self.suspect_s(peer) > 0:
            raise RemotePrefillError(f"{peer} is suspect for {self.suspect_s(peer):.1f} s more (it missed a deadline)")
        # the queue ahead of it (not itself, which start put there) plus itself
        limit = self.deadline.seconds(self.expected_s(peer, len(prompt), without=rid))
        try:
            conn, _ = await asyncio.wait_for(self.pool.take(peer), limit)
        except TimeoutError as e:
            self._suspect(peer)
            raise RemotePrefillError(f"no connection to {peer} within {limit:.1f} s") from e
        ok = False
        try:
            waited = 0.0 if arrived is None else max(0.0, time.monotonic() - arrived)
            await conn.send(PrefillOp(rid, prompt, params.temperature, params.top_p, params.seed, shape,
                                      waited, fallback, extras(params)).to_header())
            if settles:  # the op reached a prefill engine (a dead one fails above): the answer can name it now
                self.inst.serving.decide(rid, peer)
            n = len(prompt)
            dt = self.inst.dtype
            staged = {part: torch.empty((shape.layers, n, shape.kv_heads, shape.head_dim), dtype=dt)
                      for part in ("k", "v")}  # host memory; copied into the device cache on adoption
            # the link's time: each kv frame from its header to its payload's last byte. Not the span from the
            # first frame to kv_done: P sends a layer's KV as it computes it, so under a queue (or on a slow CPU)
            # the span is P's compute and the link looked as slow as P (bench/pd.py: 79-284 tok/s "network")
            cover, hasher, got, wire = Coverage(shape.layers, n), digest(), 0, 0.0
            while True:
                try:  # our clock, not the transport's: its timeout reads as any other TransportError
                    async with asyncio.timeout(limit):
                        header, plen = await conn.recv_header()
                except TimeoutError as e:
                    self._suspect(peer)
                    raise RemotePrefillError(f"no KV frame from {peer} within {limit:.1f} s") from e
                op = header.get("op")
                if op == "kv":
                    t0 = time.monotonic()
                    layer, start, cnt, part = check_kv(header, shape, n, plen)
                    cover.add(part, layer, start, cnt)
                    view = host_bytes(staged[part][layer, start:start + cnt])
                    await conn.recv_into(view, timeout=limit)
                    wire += time.monotonic() - t0
                    hasher.update(view)  # D's work, not the link's: outside the frame's time
                    got += plen
                    continue
                if plen:
                    raise RemotePrefillError(f"{op!r} frame carries {plen} unexpected payload bytes")
                if op == "error":
                    ok = True  # the session is still in step: the connection can be reused
                    raise RemotePrefillError(f"peer refused: {header.get('message')}")
                if op == "handback":
                    ok = True
                    raise HandedBack(str(header.get("message")))
                if op != "kv_done":
                    raise RemotePrefillError(f"unexpected op {op!r} from the prefill engine")
                gap = cover.missing()
                if gap is not None:
                    raise RemotePrefillError(f"incomplete KV: {gap}")
                if header.get("bytes") != got or header.get("digest") != hasher.hexdigest():
                    raise RemotePrefillError(f"KV digest/length mismatch: got {got} bytes {hasher.hexdigest()}, "
                                             f"peer sent {header.get('bytes')} bytes {header.get('digest')}")
                token = header.get("token")
                if not isinstance(token, int) or not 0 <= token < self.inst.model.shape.vocab:
                    raise RemotePrefillError(f"kv_done field 'token' = {token!r} is not a token id")
                rate = pace(header)
                ok = True
                if rate is not None:
                    self.pace[peer] = rate
                secs = max(wire, 1e-9)
                self.bytes_received += got
                self.link[peer] = got / secs
                self.inst.pd_metrics.received.inc(got)
                self.inst.pd_metrics.link(peer, got / secs, n / secs)
                return token, staged["k"], staged["v"]
        finally:
            self._give_back(peer, conn, ok)

    def _give_back(self, peer: str, conn: Connection, ok: bool) -> None:
        if ok:
            self.pool.idle.setdefault(peer, []).append(conn)
        else:
            asyncio.get_running_loop().create_task(conn.close())

    def _adopt(self, eng: Engine, rid: str, prompt: list[int], params: SamplingParams, token: int,
               k: torch.Tensor, v: torch.Tensor, peer: str) -> list[Event]:
        """In the step thread: the prefilled sequence joins the batch as a decode; its first token is out, saying
        it was prefilled on `peer` (Event.prefilled_by)."""
        if rid not in self.inst.serving.queues:
            return []
        n = len(prompt)
        done = "stop" if stops_here(params, token, eng.eos, 1) else (
            "length" if params.max_tokens <= 1 else None)
        sched = eng.scheduler
        if done is None and (len(sched.running) >= eng.limits.max_seqs or not sched.pool.grow(rid, n + 1)):
            sched.pool.free(rid)  # no room now: the request queues FCFS and prefills here when admitted
            self.fallbacks += 1
            self.inst.pd_metrics.fallbacks.inc()
            eng.submit(prompt, params, rid)
            return []
        self.adopted += 1
        self.inst.pd_metrics.remote.inc()
        if done is not None:
            return [Event(rid, token, True, done, prefilled_by=peer)]
        ps, table, cache = sched.pool.page_size, sched.pool.tables[rid], eng.cache
        slots = torch.tensor([table[p // ps] * ps + p % ps for p in range(n)], dtype=torch.long, device=cache.device)
        eng.write_kv(slots, k, v)  # a tensor-parallel instance hands every rank its KV heads (tp/kv.py)
        gen = None if params.seed is None else torch.Generator(device="cpu").manual_seed(params.seed)
        eng.requests[rid] = Request(rid, list(prompt), params, out=[token], first_token_at=time.monotonic(), gen=gen)
        sched.running[rid] = Seq(rid, n, params.max_tokens, total=n + 1, computed=n, generated=1)
        return [Event(rid, token, False, prefilled_by=peer)]

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await self.pool.close()
