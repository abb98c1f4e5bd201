"""Cooperation: a loading engine B and its full pair A run the live split per STEP, inside both batches.

Pair session: one long-lived authenticated connection per pair, opened when the pair forms (the
cooperate call), never per request. The hello/token check stays the first exchange:
  A -> B challenge, B -> A hello (proof), A -> B welcome (proof): `peerauth`, the token never on the wire
  B -> A  {"op": "pair", "layers": L, "hidden": H}  ->  {"op": "paired", "pair": id, "complete": bool}
          (complete: A holds the whole model; false: A is a pipeline receiver passing rows on)
then one frame per B step (every row of B's batch that A finishes, in one activation tensor):
  B -> A  {"op": "step", "rows": [[req, start, n, layer, sample, temperature, top_p, seed], ...],
          "end": [req, ...], "shape": [N, H], "dtype"} + raw activations (row-major, little endian;
          the rows' tokens in row order, each after B's layers 0..layer-1)
  A -> B  {"op": "tokens", "tokens": [one per sampling row, in order]}  or  {"op": "error", "message"}.
(plus the request-redirection fields of redirect.py and decode-state migration's of migration.py; the
sessions themselves are in pairsession.py, B's side in pairclient.py).

Data flow on B (`PairClient`, B's Engine hook): its scheduler batches its own requests as usual; the
step embeds every row, runs each sequence's resident prefix 0..k-1 (`staggered`), and sends the whole
step to A in one frame; A's sampled tokens come back as the step's tokens.
On A (`HostRows`, A's Engine hook): a pair step is queued and wakes A's loop; A's forward (the one
running, if it has not passed layer k by more than CATCH_UP_LAYERS, else the next) runs its own sequences
through embed and layers 0..k-1, then B's rows whose split is k join the same tensor for layers k..L-1
— B's rows and A's own traffic share one forward per layer — and the tokens go back.
KV stays split: B's paged cache holds layers 0..k-1 of its sequences, A's paged cache (pages under
"pair<id>/<req>") layers k..L-1. A sequence keeps the k it started with (its KV below k lives on B);
sequences B admits later get the resident prefix of that moment, so the split moves forward as blocks
arrive; once B holds every block, new sequences run entirely on B (k = L, sampled locally).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kascade_engine.batch import timeline
from kascade_engine.batch.emulation import layer_cost, pace
from kascade_engine.batch.engine import Event
from kascade_engine.batch.kvcache import KVCache, build_batch
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import Sampled, SamplingParams, pick
from kascade_engine.live import migration
from kascade_engine.live.redirect import Redirects

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.pages import PagePool
    from kascade_engine.batch.scheduler import Work

log = logging.getLogger(__name__)


class Downstream(Protocol):
    """A pipeline hop's next receiver (pairclient.py `PairClient`): rows this engine cannot finish go on to it."""

    def relay_async(self, meta: list[list[Any]], hidden: torch.Tensor,
                    ends: list[str]) -> Future[tuple[dict[str, Any], bytearray]]: ...

    @property
    def peer_receivers(self) -> int: ...  # loading engines past it that run these rows' later layers

    async def close(self) -> None: ...


@dataclass
class Row:
    """One sequence's chunk in a step: positions start..start+n, layers a..b-1 to run on `x` [n, H]."""

    table: list[int]
    start: int
    n: int
    a: int
    b: int
    x: torch.Tensor


# runs layers first..last-1 over hidden states [N, H] of chunks (page table, start, tokens): Engine.run_rows (a
# tensor-parallel engine sends every rank the segment first: tp/leader.py)
RunRows = Callable[[int, int, torch.Tensor, list[tuple[list[int], int, int]]], torch.Tensor]


def staggered(model: LlamaModel, cache: KVCache, rows: list[Row], knee_tokens: int = 0,
              join: Callable[[int, float], list[Row]] | None = None, run: RunRows | None = None) -> float:
    """Run every row through its own layer range in one tensor per layer segment: rows join at their
    first layer and leave after their last, so all rows present at a layer share its forward. Returns
    what the step costs on an accelerator, in layer forwards: one per layer run, or with `knee_tokens`
    one per `knee_tokens` tokens present at that layer (a forward is compute-bound past the knee, so the
    rows a loading peer adds to a full batch cost what their tokens cost: `pace`).

    `join(u, cost)`: asked before each layer u (after `cost` layer forwards so far), it returns rows that
    join the running forward from layer u on: a pair step that arrives while this engine is at a layer at
    or below its split joins this forward instead of the next step. A joining row whose first layer is
    below u first catches up alone (its layers a..u-1, charged like any forward: the step gets longer by
    them) — the caller bounds how far back it lets rows join. With `join` the forward runs one layer at a
    time (the same layer kernels, cut where rows may join).

    `run`: the engine's `run_rows` (default: `model` over `cache` here): a tensor-parallel engine's runs every
    segment on all its ranks."""
    if run is None:
        def run(u: int, v: int, x: torch.Tensor, items: list[tuple[list[int], int, int]]) -> torch.Tensor:
            return model.run_layers(u, v, x, build_batch(cache, items))
    if join is None:
        return _segments(run, rows, knee_tokens)
    cost = 0.0
    u = min((r.a for r in rows), default=0)
    while True:
        late = join(u, cost)
        behind = [r for r in late if r.a < u]
        if behind:  # their layers below u, alone (staggered among themselves), then they join at u
            ends = [r.b for r in behind]
            for r in behind:
                r.b = min(r.b, u)
            cost += _segments(run, behind, knee_tokens)
            for r, b in zip(behind, ends, strict=True):  # (a row whose range ended below u is done: a = b)
                r.a, r.b = min(u, b), b
        rows.extend(late)
        if not rows or u >= max(r.b for r in rows):
            return cost
        present = sorted((r for r in rows if r.a <= u < r.b), key=lambda r: r.n > 1)  # decodes first
        if present:
            cost += layer_cost(sum(r.n for r in present), 1, knee_tokens)
            _run(run, present, u, u + 1)
        u += 1


def _run(run: RunRows, present: list[Row], u: int, v: int) -> None:
    x = run(u, v, torch.cat([r.x for r in present]), [(r.table, r.start, r.n) for r in present])
    at = 0
    for r in present:
        r.x, at = x[at:at + r.n], at + r.n


def _segments(run: RunRows, rows: list[Row], knee_tokens: int) -> float:
    bounds = sorted({r.a for r in rows} | {r.b for r in rows})
    cost = 0.0
    for u, v in itertools.pairwise(bounds):
        present = sorted((r for r in rows if r.a <= u and r.b >= v), key=lambda r: r.n > 1)  # decodes first
        if not present:
            continue
        cost += layer_cost(sum(r.n for r in present), v - u, knee_tokens)
        _run(run, present, u, v)
    return cost


def own_rows(engine: Engine, work: list[Work], end: Callable[[str], int]) -> tuple[list[Row], list[int]]:
    """Rows of this engine's own requests (embedded; layers 0..end(id)-1) and which ones sample."""
    m, pool = engine.model, engine.scheduler.pool
    rows, sampling = [], []
    for i, w in enumerate(work):
        toks = engine.requests[w.id].tokens
        x = m.embed(torch.tensor(toks[w.start:w.end], dtype=torch.long, device=m.device))
        rows.append(Row(pool.tables[w.id], w.start, w.n, 0, end(w.id), x))
        if w.end == len(toks):
            sampling.append(i)
    return rows, sampling


# -- A: host B's rows inside A's own batch -------------------------------------------------------
@dataclass
class PairStep:
    pair: int
    rows: list[list[Any]]  # [req, start, n, layer, sample, temperature, top_p, seed]
    hidden: torch.Tensor
    done: Callable[[list[int] | Exception], None]
    waiting: int | None = None  # the peer's queued requests (a loading B that takes redirected requests)
    refused: list[Any] = field(default_factory=list)  # [[req, message]]: redirected requests B could not run
    reply: dict[str, Any] = field(default_factory=dict)  # redirect fields for the answer (redirect.py)
    migrate: list[Any] = field(default_factory=list)  # [[req, k]]: sequences B takes over whole (migration.py)
    payload: bytes = b""  # the answer's raw bytes: migrated K/V
    seen: int | None = None  # redirect entries the peer had received when it sent this (redirect.py)


# A pair step that reaches a running forward at most this many layers past its split still joins it: its rows
# run those layers alone first (each costs a layer forward: the step gets that much longer), so they finish at
# the end of this step rather than the next one (a whole step later). Further back it waits for the next step.
# It bounds what one forward adds in all (bench g2: several late frames per step, each catching up, stretched
# A's own requests' steps to 1.8 s).
CATCH_UP_LAYERS = 2


def take_late(inbox: deque[PairStep], u: int, budget: int) -> tuple[list[PairStep], int]:
    """The pair steps at the head of `inbox` (in arrival order) that join a forward about to run layer u, and
    the layers their catch-up adds: the rows joining here catch up together (layers lowest..u-1, once), and
    that may cost at most `budget` layers."""
    late: list[PairStep] = []
    lowest = u
    while inbox and u - min(lowest, _first_layer(inbox[0])) <= budget:
        lowest = min(lowest, _first_layer(inbox[0]))
        late.append(inbox.popleft())
    return late, u - lowest


def _first_layer(st: PairStep) -> int:
    """The lowest layer any row of a pair step starts at (0 for a malformed row: it waits for a step start,
    where `_rows` names what is wrong; an empty step, a poll, joins at any layer)."""
    firsts = [r[3] if isinstance(r, list) and len(r) == 8 and isinstance(r[3], int) else 0 for r in st.rows]
    return min(firsts, default=1 << 30)


@dataclass
class HostRows:
    """A's hook: pair steps queue here (event loop) and join A's next step (worker thread)."""

    inbox: deque[PairStep] = field(default_factory=deque)
    ends: deque[str] = field(default_factory=deque)  # page keys to free at the next step
    gens: dict[str, torch.Generator | None] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    stops: dict[str, int] = field(default_factory=dict)  # page key -> the layer its rows leave here (sticky)
    downstream: Downstream | None = None  # pipeline: rows this engine cannot finish go on to the next receiver
    forwarded: set[str] = field(default_factory=set)  # page keys whose later layers live downstream
    rows_hosted: int = 0  # metric: B rows finished here
    migrated: int = 0  # metric: sequences handed to B whole (decode-state migration)
    steps_hosted: int = 0
    relays_out: int = 0  # pipeline hop: relayed frames whose answer has not come back yet
    max_relays_out: int = 0  # metric: most at once (> 1: this hop ran a step while earlier rows were downstream)
    shared_steps: int = 0  # metric: steps where pair rows and this engine's own rows shared the forward
    joined: int = 0  # metric: pair steps that joined a forward already running (at their split layer)
    caught_up: int = 0  # metric: layers joining rows ran alone to catch up with a forward already past their split
    layer_s: float = 0.0  # emulated seconds per layer forward (benchmarks; 0: off)
    knee_tokens: int = 0  # emulation: tokens per layer forward before it costs more (0: never)
    redirects: Redirects = field(default_factory=Redirects)  # queued requests handed to a live B (redirect.py)
    closed: list[int] = field(default_factory=list)  # pairs whose session ended (their handed requests fail)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pending(self) -> bool:
        return bool(self.inbox or self.ends or self.closed)

    def abort(self, rid: str) -> None:
        self.redirects.abort(rid)

    def take_events(self) -> list[Event]:
        return self.redirects.take_events()

    def prepare(self, engine: Engine) -> None:
        pass

    def submit(self, step: PairStep, ends: list[str]) -> None:
        with self._lock:
            self.ends.extend(f"pair{step.pair}/{r}" for r in ends)
            self.inbox.append(step)

    def close_pair(self, pair: int) -> None:
        with self._lock:
            self.ends.extend(k for k in list(self.lengths) if k.startswith(f"pair{pair}/"))
            self.closed.append(pair)

    def forward(self, engine: Engine, work: list[Work]) -> list[int]:
        m, pool, L = engine.model, engine.scheduler.pool, engine.model.shape.layers
        with self._lock:
            steps, ends, closed = list(self.inbox), list(self.ends), list(self.closed)
            self.inbox.clear()
            self.ends.clear()
            self.closed.clear()
        if engine.tp > 1 and not (steps or ends or closed):  # no pair work: the ranks follow the plain `Step`
            with torch.inference_mode():
                return engine._forward(work)
        for key in ends:
            self.redirects.ended(engine, key, "the live peer ended it", self.gens.get(key))
            self._forget(pool, key)
        down_ends = [k for k in ends if k in self.forwarded]
        self.forwarded.difference_update(down_ends)
        try:
            rows, sampling = own_rows(engine, work, lambda _: L)
            picks: list[Sampled | tuple[SamplingParams, torch.Generator | None]] = [
                engine.requests[work[i].id] for i in sampling]
            accepted: list[tuple[PairStep, list[tuple[Row, list[Any]]]]] = []
            for pair in closed:
                self.redirects.close_pair(engine, pair)
            rows.extend(self._accept(engine, steps, accepted))
            t0 = time.perf_counter()
            if timeline.on():
                for w in work:
                    if w.start == 0:
                        timeline.mark("a-start", w.id)

            catch_up = [CATCH_UP_LAYERS]  # layers this forward may still add for late rows

            def join(u: int, cost: float) -> list[Row]:
                """Before layer u: pair steps that arrived meanwhile join this forward if every row of
                theirs starts at layer u - CATCH_UP_LAYERS or later (in arrival order: answers go back in
                frame order); rows from below u catch up first (`staggered`)."""
                pace(t0, cost, self.layer_s)  # the emulated accelerator reaches layer u now
                with self._lock:
                    late, spent = take_late(self.inbox, u, catch_up[0])
                if not late:
                    return []
                catch_up[0] -= spent  # a forward is lengthened by at most CATCH_UP_LAYERS in all
                for st in late:
                    timeline.mark("a-join", "-", layer=u, rows=len(st.rows), behind=max(0, u - _first_layer(st)))
                    self.caught_up += max(0, u - _first_layer(st))
                self.joined += len(late)
                steps.extend(late)
                return self._accept(engine, late, accepted)

            # a tensor-parallel engine takes pair steps at step boundaries: a join point per layer would send its
            # ranks every layer as a message of its own (tp/leader.py `run_rows`)
            pace(t0, staggered(m, engine.cache, rows, self.knee_tokens, join if engine.tp == 1 else None,
                               engine.run_rows), self.layer_s)
            timeline.mark(
                "a-step",
                "-",
                own=sum(w.n for w in work),
                hosted=sum(r.n for _, mine in accepted for r, _ in mine),
                s=f"{time.perf_counter() - t0:.3f}",
            )
            here: list[torch.Tensor] = [rows[i].x[-1:] for i in sampling]  # rows sampled on this engine
            slots: list[tuple[PairStep, int, str]] = []  # (step, index of its token, key) per pair row sampled here
            relay: list[tuple[PairStep, int, Row, list[Any]]] = []  # pair rows that go on down the pipeline
            step_toks: dict[int, list[int]] = {}
            for st, mine in accepted:
                n_tok = 0
                for row, meta in mine:
                    key = f"pair{st.pair}/{meta[0]}"
                    if row.b < L or not m.resident("head"):
                        relay.append((st, n_tok if meta[4] else -1, row, meta))
                    elif meta[4]:
                        here.append(row.x[-1:])
                        slots.append((st, n_tok, key))
                        picks.append((SamplingParams(temperature=float(meta[5]), top_p=float(meta[6])),
                                      self.gens[key]))
                    n_tok += bool(meta[4])
                step_toks[id(st)] = [-1] * n_tok
            toks: list[int] = []
            if here:
                logits = m.logits(torch.cat(here))
                toks = pick(logits, picks, engine.eos)
            for (st, j, key), tok in zip(slots, toks[len(sampling):], strict=True):
                step_toks[id(st)][j] = tok
                self.redirects.token(key, tok, engine.eos)
            relayed: Future[tuple[dict[str, Any], bytearray]] | None = None
            if relay or down_ends:
                down = self.downstream  # read once: the event loop may drop it meanwhile (peering.py)
                if down is None:
                    raise RuntimeError("pair rows need layers this engine does not hold and it has no downstream")
                meta = [[f"pair{st.pair}/{mt[0]}", row.start, row.n, row.b, *mt[4:]] for st, _, row, mt in relay]
                self.forwarded.update(str(x[0]) for x in meta)
                hidden = (torch.cat([row.x for _, _, row, _ in relay]) if relay
                          else torch.empty(0, m.shape.hidden, dtype=m.dtype, device=m.device))
                # not awaited here: this hop's next step runs while the rows go on down the pipeline (λScale's
                # pipelining: every stage busy with a different step). The steps that relayed rows are answered
                # when the downstream's tokens come back (`_answer_relayed`), in frame order by the session.
                relayed = down.relay_async(meta, hidden, down_ends)
                with self._lock:
                    self.relays_out += 1
                    self.max_relays_out = max(self.max_relays_out, self.relays_out)
        except Exception as e:
            for st in steps:
                st.done(e)
            raise
        self.shared_steps += bool(work and accepted)
        waiting_down: list[PairStep] = []
        for st, _ in accepted:
            if st.waiting is not None and m.complete:  # a loading B that takes our queued requests
                st.reply = {"redirect": self.redirects.pick(engine, st.pair, st.waiting, st.seen),
                            "abort": self.redirects.aborts.pop(st.pair, []), "queued": len(engine.scheduler.waiting)}
            if st.migrate:
                st.reply["migrated"], st.payload = self._migrate(engine, st)
            if relayed is not None and any(s is st for s, _, _, _ in relay):
                waiting_down.append(st)
            else:
                st.done(step_toks[id(st)])
            self.rows_hosted += len(st.rows)
            self.steps_hosted += 1
        if relayed is not None:
            slots_down = [(st, j) for st, j, _, _ in relay]
            relayed.add_done_callback(lambda f: self._answer_relayed(f, waiting_down, slots_down, step_toks))
        return toks[:len(sampling)]

    def _accept(self, engine: Engine, steps: list[PairStep],
                accepted: list[tuple[PairStep, list[tuple[Row, list[Any]]]]]) -> list[Row]:
        """Pair steps into this forward: their rows (a step with a bad row is answered with the error)."""
        out: list[Row] = []
        for st in steps:
            for rid, why in st.refused:
                self.redirects.ended(engine, f"pair{st.pair}/{rid}", f"the live peer refused it: {why}")
            try:
                mine = self._rows(engine, st)
            except ValueError as e:
                st.done(e)
                continue
            accepted.append((st, mine))
            out.extend(r for r, _ in mine)
        return out

    def _answer_relayed(self, fut: Future[tuple[dict[str, Any], bytearray]], steps: list[PairStep],
                        slots: list[tuple[PairStep, int]], step_toks: dict[int, list[int]]) -> None:
        """The downstream answered the rows this hop relayed: their tokens complete the steps' answers (a
        failure there fails exactly those steps)."""
        with self._lock:
            self.relays_out -= 1
        try:
            reply, _ = fut.result()
            if reply.get("op") != "tokens":
                raise RuntimeError(f"pair refused the step: {reply.get('message', reply)}")
            down = iter(int(t) for t in reply["tokens"])
            for st, j in slots:
                if j >= 0:
                    step_toks[id(st)][j] = next(down)
        except Exception as e:
            for st in steps:
                st.done(e if isinstance(e, RuntimeError) else RuntimeError(f"pipeline downstream failed: {e!r}"))
            return
        for st in steps:
            st.done(step_toks[id(st)])

    def _forget(self, pool: PagePool, key: str) -> None:
        """A pair sequence ends here (ended on B, or moved to it): its pages and per-sequence state go."""
        pool.free(key)
        for d in (self.gens, self.lengths, self.stops):
            d.pop(key, None)

    def _migrate(self, engine: Engine, st: PairStep) -> tuple[list[list[Any]], bytes]:
        """Hand B the sequences it asked for (migration.py): their K/V here and sampler state, then free them."""
        L, out, parts = engine.model.shape.layers, [], []
        for item in st.migrate:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int)):
                out.append([str(item), 0, 0, "a migrate entry must be [req, k]", None])
                continue
            rid, k = str(item[0]), item[1]
            key = f"pair{st.pair}/{rid}"
            n = self.lengths.get(key)
            if n is None or key in self.forwarded or self.stops.get(key, L) != L or not 0 <= k < L:
                out.append([rid, k, 0, f"{rid} is not held here whole from layer {k}", None])
                continue
            parts.append(migration.take_from(engine, engine.scheduler.pool.tables[key], k, n))
            out.append([rid, k, n, "", migration.gen_state(self.gens.get(key))])
            self._forget(engine.scheduler.pool, key)  # B holds it whole now
            self.migrated += 1
        return out, b"".join(parts)

    def _rows(self, engine: Engine, st: PairStep) -> list[tuple[Row, list[Any]]]:
        m, pool, L = engine.model, engine.scheduler.pool, engine.model.shape.layers
        out, at = [], 0
        for meta in st.rows:
            if not (isinstance(meta, list) and len(meta) == 8):
                raise ValueError(f"pair row {meta!r} must be [req, start, n, layer, sample, temperature, top_p, seed]")
            req, start, n, layer = meta[0], meta[1], meta[2], meta[3]
            if not (isinstance(start, int) and isinstance(n, int) and isinstance(layer, int)) or start < 0 or n < 1:
                raise ValueError(f"pair row {req!r}: start {start!r} / n {n!r} must be ints >= 0 / >= 1")
            if not 0 <= layer <= L:
                raise ValueError(f"pair row {req!r}: layer {layer} outside 0..{L}")
            key = f"pair{st.pair}/{req}"
            if start > self.lengths.get(key, 0):
                raise ValueError(f"pair row {req!r}: KV here holds {self.lengths.get(key, 0)} positions, "
                                 f"new tokens start at {start}")
            if not pool.grow(key, start + n):
                raise ValueError(f"pair row {req!r}: no free KV pages for {start + n} positions")
            if key not in self.gens:
                seed = meta[7]
                self.gens[key] = torch.Generator(device="cpu").manual_seed(int(seed)) if seed is not None else None
            self.lengths[key] = max(self.lengths.get(key, 0), start + n)
            x = st.hidden[at:at + n].to(m.device, m.dtype)
            at += n
            end = self.stops.get(key, layer)  # a sequence keeps its range: its KV for later layers lives downstream
            if key not in self.stops:  # first rows: the layers held here from `layer` on; a pipeline sends the rest on
                while end < L and m.resident(f"layer.{end}"):
                    end += 1
                self.stops[key] = end
            if end < L and self.downstream is None:
                raise ValueError(f"pair row {req!r}: layer {end} is not resident here and no pipeline follows")
            out.append((Row(pool.tables[key], start, n, layer, end, x), meta))
        if at != st.hidden.shape[0]:
            raise ValueError(f"pair step rows cover {at} tokens, the activation has {st.hidden.shape[0]}")
        return out
