"""Prefill server: the prefill engine's side of disaggregated serving. A decode engine asks it to prefill a
prompt; it runs the prompt in its own batch (chunked prefill, next to its other requests) and ships the
prompt's KV to the decode engine layer by layer, while the next layer computes.

Data flow: the data port's hello (live.Finisher.handle) -> a first frame {"op": "prefill"} ->
`PrefillServer.handle` (checks tokens and the peer's model shape; kv_wire.py) -> `Engine.submit(tokens,
max_tokens=1)` with a request queue in `Serving.queues` -> the step loop runs `KVShipper.forward`: one layer
at a time for the whole batch; after each layer the K and V of the remote sequences' new positions are
copied to host memory and handed to the event loop -> `handle` sends them as kv frames as they come ->
the step's sampled first token arrives as the request's `Event` -> {"op": "kv_done"} with the digest
and this engine's measured prefill rate (the decode engine's pace for the prompts it queues here, remote_prefill.py).
A failed step, an unknown shape, or a decode engine that goes away ends only that request.
A tensor-parallel prefill engine (Engine.layerwise False: its followers run a step's layers as one message) runs the
step whole, then reads every layer's new KV at once, gathered from its ranks at rank 0 (Engine.read_kv, tp/kv.py):
the frames are the same whole-model KV a TP-1 engine sends, only none leaves before the step's last layer.
A converted decoder serving here (the router may name one as another decoder's prefill engine) follows its
hand-back rule for these prompts too (handback.HandBack.refuses / watch_served): it declines one on arrival, or
gives it back after its bound, with {"op": "handback"}; the decode engine then prefills it on its fallback.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kascade_engine.batch.emulation import layer_cost, pace
from kascade_engine.batch.engine import Event
from kascade_engine.batch.kvcache import build_batch
from kascade_engine.batch.sampling import EXTRAS, SamplingParams, pick, with_extras
from kascade_engine.net.transport import Connection, TransportError
from kascade_engine.pd.handback import SERVED
from kascade_engine.pd.kv_wire import Header, KVShape, KVWireError, digest, fallback, kv_header, waited_s

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine, StepHooks
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.batch.scheduler import Work
    from kascade_engine.net.pacing import TokenBucket
    from kascade_engine.pd.handback import HandBack
    from kascade_engine.pd.metrics import PDMetrics

log = logging.getLogger(__name__)


class KVHost(Protocol):
    """What the KV shape is read from: the engine instance's model, cache and dtype (EngineInstance is one)."""

    @property
    def model(self) -> LlamaModel: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def dtype(self) -> torch.dtype: ...


class _Streams(Protocol):
    @property
    def queues(self) -> dict[str, asyncio.Queue[Event | Exception]]: ...  # a request's events are routed here

    @property
    def wake(self) -> asyncio.Event: ...

    def abort(self, rid: str) -> None: ...


class _Limits(Protocol):
    @property
    def max_prompt_tokens(self) -> int: ...


class _Requests(Protocol):
    def on_request(self, prompt_tokens: int) -> None: ...


class PrefillHost(KVHost, Protocol):
    """What the prefill server reads of its engine instance (EngineInstance is one), each time: bind may rebuild
    the engine and model for another dtype."""

    @property
    def phase(self) -> enum.Enum: ...

    @property
    def config(self) -> _Limits: ...

    @property
    def serving(self) -> _Streams: ...

    @property
    def handback(self) -> HandBack: ...

    @property
    def metrics(self) -> _Requests: ...

    @property
    def pd_metrics(self) -> PDMetrics: ...

    @property
    def egress(self) -> TokenBucket | None: ...


def kv_shape(inst: KVHost) -> KVShape:
    """The KV this engine ships or takes: the whole model's KV heads, whatever its tensor parallelism (a TP
    instance gathers and scatters its ranks' heads at rank 0: Engine.read_kv / write_kv, tp/kv.py)."""
    s, eng = inst.model.shape, inst.engine
    return KVShape(s.layers, eng.kv_heads, s.head_dim, str(inst.dtype).removeprefix("torch."),
                   eng.cache.k.element_size())


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


@dataclass(frozen=True)
class GivenBack:
    """Queued for a served prompt this engine handed back (handback.HandBack.watch_served), and why."""

    why: str


@dataclass(frozen=True)
class KVPiece:
    """K and V of positions start..start+n-1 of one layer of one remote sequence, in host memory."""

    layer: int
    start: int
    n: int
    k: torch.Tensor
    v: torch.Tensor


Sink = Callable[[KVPiece], None]  # where a remote sequence's KV pieces go (PrefillServer._one's queue)


@dataclass
class KVShipper:
    """The prefill engine's step hook (Engine.coop): runs the batch layer by layer and hands each layer's
    new KV of remote sequences to their sinks. Wraps the hook it was installed over (live pair rows), and stays
    when that one is replaced (Engine.wrap_hook): the sinks of prompts being prefilled stay with it."""

    inner: StepHooks | None  # replaced under it (Engine.set_hook, Engine.step_down), even while a step runs
    sinks: dict[str, Sink] = field(default_factory=dict)
    _ran: StepHooks | None = field(default=None, repr=False)  # the inner hook that ran the last step

    def pending(self) -> bool:
        return (inner := self.inner) is not None and inner.pending()

    def abort(self, rid: str) -> None:
        if (inner := self.inner) is not None:
            inner.abort(rid)

    def take_events(self) -> list[Event]:
        # the tokens that landed in the step's inner hook too, if it was replaced during the step (a live pair
        # stepping down inside its forward): asking only the new one lost them
        ran, self._ran = self._ran, None
        inner = self.inner
        out = ran.take_events() if ran is not None and ran is not inner else []
        return out + (inner.take_events() if inner is not None else [])

    def prepare(self, engine: Engine) -> None:
        if (inner := self.inner) is not None:
            inner.prepare(engine)

    @staticmethod
    def _slots(engine: Engine, w: Work) -> list[int]:
        table, ps = engine.scheduler.pool.tables[w.id], engine.cache.page_size
        return [table[p // ps] * ps + p % ps for p in range(w.start, w.end)]

    def _ship(self, engine: Engine, remote: list[tuple[Work, Sink]], layer: int) -> None:
        cache = engine.cache
        for w, sink in remote:
            slots = torch.tensor(self._slots(engine, w), dtype=torch.long, device=cache.device)
            k = cache.k[layer].index_select(0, slots).to("cpu").contiguous()  # a new host tensor: pages get reused
            v = cache.v[layer].index_select(0, slots).to("cpu").contiguous()
            sink(KVPiece(layer, w.start, w.n, k, v))

    def _ship_all(self, engine: Engine, remote: list[tuple[Work, Sink]]) -> None:
        """After the step: every layer's new KV of every remote sequence, read at once (`Engine.read_kv`: on a
        tensor-parallel instance one gather of every rank's heads), shipped in layer order."""
        slots = [self._slots(engine, w) for w, _ in remote]
        k, v = engine.read_kv(torch.tensor([s for ss in slots for s in ss], dtype=torch.long,
                                           device=engine.cache.device))
        for layer in range(k.shape[0]):
            at = 0
            for w, sink in remote:
                sink(KVPiece(layer, w.start, w.n, k[layer, at:at + w.n].contiguous(),
                             v[layer, at:at + w.n].contiguous()))
                at += w.n

    def forward(self, engine: Engine, work: list[Work]) -> Sequence[int | None]:
        # each sink read once, here: the event loop drops a request's sink while this step runs (its decode engine
        # went away, PrefillServer._one); a later `sinks[id]` raised KeyError and failed the step, so every request
        # on this engine. A dropped request's KV still goes to its old sink, which nobody reads, until the step ends
        remote = [(w, sink) for w in work if (sink := self.sinks.get(w.id)) is not None]
        L = engine.model.shape.layers
        self._ran = inner = self.inner
        # pair rows share this step, or a tensor-parallel instance (its followers run the step's layers as one
        # message): run it whole, then ship every layer
        if not remote or (inner is not None and inner.pending()) or not engine.layerwise:
            toks = inner.forward(engine, work) if inner is not None else engine._forward(work)
            if remote:
                self._ship_all(engine, remote)
            return toks
        m, pool = engine.model, engine.scheduler.pool
        ids: list[int] = []
        rows: list[int] = []
        for w in work:
            ids.extend(engine.requests[w.id].tokens[w.start:w.end])
            if w.end == len(engine.requests[w.id].tokens):
                rows.append(len(ids) - 1)
        batch = build_batch(engine.cache, [(pool.tables[w.id], w.start, w.n) for w in work])
        h = m.embed(torch.tensor(ids, dtype=torch.long, device=m.device))
        # an emulated accelerator (--emulate-layer-ms, the hook's HostRows.layer_s): a layer takes at least that
        # here too, past the knee (--emulate-knee-tokens) in proportion to its tokens, as `staggered` charges every
        # other step; without it a prefill engine that ships KV ran at the host CPU's pace whatever the setting
        layer_s, t0 = getattr(inner, "layer_s", 0.0), time.perf_counter()
        per_layer = layer_cost(len(ids), 1, getattr(inner, "knee_tokens", 0))
        for layer in range(L):  # one layer for the whole batch, then its KV leaves while the next computes
            h = m.run_layers(layer, layer + 1, h, batch)
            pace(t0, (layer + 1) * per_layer, layer_s)
            self._ship(engine, remote, layer)
        logits = m.logits(h[torch.tensor(rows, dtype=torch.long, device=m.device)])
        return pick(logits, [engine.requests[w.id] for w in work if w.end == len(engine.requests[w.id].tokens)],
                    engine.eos)


def _tokens(h: Header, vocab: int, limit: int) -> list[int]:
    toks = h.get("tokens")
    if not isinstance(toks, list) or not toks or len(toks) > limit:
        raise KVWireError(f"field 'tokens': a non-empty list of at most {limit} token ids is required")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in toks):
        raise KVWireError(f"field 'tokens': token ids must be ints in 0..{vocab - 1}")
    return toks


def _params(h: Header) -> SamplingParams:
    p = h.get("params") or {}
    try:
        seed = p.get("seed")
        base = SamplingParams(max_tokens=1, temperature=float(p.get("temperature", 0.0)),
                              top_p=float(p.get("top_p", 1.0)), seed=None if seed is None else int(seed))
        return with_extras(base, {k: v for k, v in p.items() if k in EXTRAS})
    except (TypeError, ValueError, AttributeError) as e:
        raise KVWireError(f"field 'params': {e}") from None


class PrefillServer:
    """Serves prefill requests of decode engines on this engine's data port (one per connection at a time)."""

    def __init__(self, inst: PrefillHost) -> None:
        self.inst = inst
        self.requests = 0  # metrics: prefills served for decode engines
        self.bytes_sent = 0
        self.refused = 0

    def _shipper(self) -> KVShipper:
        # installed on first use, over the hook then (a live pair's), and it stays: a new pair goes under it
        return self.inst.engine.wrap_hook(KVShipper, KVShipper)

    async def handle(self, conn: Connection, first: Header) -> None:
        header: Header | None = first
        while header is not None:
            if header.get("op") != "prefill":
                await conn.send({"op": "error", "message": f"unexpected op {header.get('op')!r} (want 'prefill')"})
                return
            if not await self._one(conn, header):
                return
            try:
                header, _ = await conn.recv(max_payload=0)
            except TransportError:
                return

    async def _one(self, conn: Connection, h: Header) -> bool:
        """Serve one prefill; False when the connection is gone."""
        inst, req = self.inst, str(h.get("req", ""))
        try:
            if not inst.model.complete or inst.phase.value in ("draining", "released"):
                raise KVWireError(f"engine is {inst.phase.value}; it prefills only while serving")
            shape = kv_shape(inst)
            bad = shape.mismatch(h)
            if bad is not None:
                raise KVWireError(bad)
            toks = _tokens(h, inst.model.shape.vocab, inst.config.max_prompt_tokens)
            params = _params(h)
            # queued by its arrival: a prompt a converted decoder hands back has waited there already, and goes
            # ahead of prompts that arrived after it (kv_wire.PrefillOp)
            arrived = time.monotonic() - waited_s(h)
            peer_fallback = fallback(h)
        except KVWireError as e:
            self.refused += 1
            inst.pd_metrics.refused.inc()
            log.warning("prefill %s from %s refused: %s", req, conn.peer, e)
            try:
                await conn.send({"op": "error", "req": req, "message": str(e)})
            except TransportError:
                return False
            return True
        # a converted decoder prefilling for another decode engine follows its own hand-back rule (handback.py), as
        # for the prompts it prefills itself: it declines one it cannot predict finishing, or would finish later than
        # the requester's fallback prefill engine, at once; and gives back one that makes no progress (or too little)
        # for its hand-back bound. Without this, such a prompt waited here at 0 tokens a step until the batch drained
        declined = inst.handback.refuses(len(toks), peer_fallback)
        if declined is not None:
            inst.handback.count(req, declined, SERVED, "on arrival")
            await conn.send({"op": "handback", "req": req, "message": declined})
            return True
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        rid = f"pd-{uuid.uuid4().hex[:12]}"
        shipper = self._shipper()

        def sink(piece: KVPiece) -> None:  # called in the step thread
            loop.call_soon_threadsafe(q.put_nowait, piece)

        shipper.sinks[rid] = sink
        inst.serving.queues[rid] = q  # the step loop routes this request's Event (first token or error) here
        try:
            inst.engine.submit(toks, params, rid, arrived=arrived)
        except ValueError as e:
            shipper.sinks.pop(rid, None)
            inst.serving.queues.pop(rid, None)
            await conn.send({"op": "error", "req": req, "message": str(e)})
            return True
        inst.metrics.on_request(len(toks))
        inst.serving.wake.set()
        inst.handback.watch_served(rid, len(toks), peer_fallback, lambda why: q.put_nowait(GivenBack(why)))
        t0, hasher, sent, frames = time.monotonic(), digest(), 0, 0
        try:
            while True:
                item = await q.get()
                if isinstance(item, KVPiece):
                    for part, t in (("k", item.k), ("v", item.v)):
                        raw = host_bytes(t)
                        hasher.update(raw)
                        await conn.send(kv_header(req, item.layer, item.start, item.n, part, shape), raw)
                        if inst.egress is not None:  # serving traffic: it went at once; weights wait for it
                            inst.egress.charge(len(raw))
                        sent += len(raw)
                        frames += 1
                    continue
                if isinstance(item, GivenBack):  # out of this batch (handback.py): the requester prefills it elsewhere
                    await conn.send({"op": "handback", "req": req, "message": item.why})
                    return True
                if isinstance(item, Exception) or (isinstance(item, Event) and item.token < 0):
                    why = item if isinstance(item, Exception) else item.reason
                    await conn.send({"op": "error", "req": req, "message": f"prefill failed: {why}"})
                    return True
                assert isinstance(item, Event)
                done: Header = {"op": "kv_done", "req": req, "token": item.token, "frames": frames, "bytes": sent,
                        "digest": hasher.hexdigest()}
                rate = inst.engine.meter.prefill_rate()  # the requester's pace for prompts it queues here (kv_wire)
                if rate:
                    done["rate"] = rate
                await conn.send(done)
                self.requests += 1
                self.bytes_sent += sent
                inst.pd_metrics.served.inc()
                inst.pd_metrics.sent.inc(sent)
                log.info("prefill %s for %s: %d tokens, %d KV bytes in %d frames, %.3f s", req, conn.peer,
                         len(toks), sent, frames, time.monotonic() - t0)
                return True
        except TransportError as e:
            log.warning("prefill %s: decode engine %s went away: %s", req, conn.peer, e)
            inst.serving.abort(rid)
            return False
        finally:
            shipper.sinks.pop(rid, None)
            inst.serving.queues.pop(rid, None)
