"""Request redirection (BlitzScale): the overloaded source A hands requests still queued in its scheduler
to its live pair B, over the pair's one connection; B runs them split like its own (its resident prefix
on B, the rest in A's batch), and A, which samples every split row, streams their tokens to its clients.

Wire (fields added to the pair session's frames, cooperation.py):
  B -> A  step {"waiting": n (B's queued requests), "refused": [[req, message], ...],
               "seen": n (redirect entries B has received over the pair so far)}
  A -> B  tokens {"redirect": [[req, prompt, max_tokens, temperature, top_p, seed, stop_token_ids], ...],
                  "abort": [req, ...] (A's client went away), "queued": n (A's queue after this reply)}
B keeps stepping (an empty frame is a poll) while A reports a queue, so the redirect flow does not
depend on B having traffic of its own. A hands over from the tail of its queue (the requests that
would wait longest) while its queue is longer than B's, and only requests that generated nothing yet
(no KV anywhere). B's queue counts the requests on their way to it: handed over in answers B had not
read when it sent the frame (A's count handed minus B's "seen"). B keeps several steps out, so A often
answers two or more of its frames at one step's end, each with the queue B had before any of this
step's hand-overs; weighed each alone, A handed over its whole queue, the requests its next step would
have run among them, and those waited for B's next step and then a whole step of A's (bench live,
ZigZag's worst TTFTs, ADR 0008). The request keeps its id: B submits it under that id; A's serving queue for it stays
and is fed from here. Data flow on A (all in its step thread): `pick` (hand over) -> `token` per row
sampled for a handed request -> `Event`s -> Engine.step's events -> Serving; `abort` forwards a client's
abort to the peer.

A handed request whose peer drops it unfinished (B released or scaled down, its step failed, it refused
the entry, the pair connection broke: `ended` / `close_pair`) is taken back, never failed: A knows its
prompt, every token it streamed so far (A sampled them) and its sampler state (the pair row's generator),
so it queues prompt + those tokens at the front of its own queue with the tokens still owed, under the same
id. Greedy output is unchanged; a seeded request continues from the same generator state. Its client sees
one stream. A request taken back is not handed over again (a peer that refused it would refuse it again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kascade_engine.batch import timeline
from kascade_engine.batch.engine import Event
from kascade_engine.batch.sampling import SamplingParams, extras, stops_here, with_extras

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class Handed:
    rid: str
    prompt: list[int]
    params: SamplingParams
    pair: int
    out: list[int] = field(default_factory=list)  # tokens streamed to the client so far (sampled here)


def requeue(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, out: list[int]) -> str | None:
    """Take back a request a peer dropped after streaming `out`: queue prompt + `out` first (it has waited
    longest) under the same id with the tokens still owed, so the client's stream goes on. The error text
    when the engine cannot (never for a request it admitted; the caller must not lose it silently)."""
    rest = replace(params, max_tokens=params.max_tokens - len(out))
    try:
        engine.submit(prompt + out, rest, rid, front=True)
    except ValueError as e:
        return str(e)
    return None


def params_from_wire(entry: list[Any]) -> tuple[str, list[int], SamplingParams]:
    """B's side: one "redirect" entry -> (request id, prompt, params); ValueError names what is wrong."""
    if not (isinstance(entry, list) and len(entry) in (7, 8) and isinstance(entry[0], str)
            and isinstance(entry[1], list)):
        raise ValueError(f"redirect entry {entry!r} must be [req, prompt, max_tokens, temperature, top_p, seed, stop"
                         "(, sampling extras)]")
    rid, prompt, max_tokens, temperature, top_p, seed, stop = entry[:7]
    if not all(isinstance(t, int) for t in prompt) or not isinstance(max_tokens, int) or not isinstance(stop, list):
        raise ValueError(f"redirect entry for {rid!r}: prompt/stop must be int lists and max_tokens an int")
    params = SamplingParams(max_tokens, float(temperature), float(top_p),
                            None if seed is None else int(seed), tuple(int(t) for t in stop))
    return rid, prompt, with_extras(params, entry[7]) if len(entry) == 8 else params


class Redirects:
    """A's side: the requests handed to pairs, by page key ("pair<id>/<req>"), and the events they made."""

    def __init__(self) -> None:
        self.handed: dict[str, Handed] = {}
        self.events: list[Event] = []
        self.aborts: dict[int, list[str]] = {}  # pair -> request ids to abort there (sent with its next reply)
        self.total = 0  # metric: requests handed over
        self.taken_back = 0  # metric: handed requests a peer dropped unfinished, queued here again
        self.sent: dict[int, int] = {}  # pair -> redirect entries handed to it so far (its "seen" catches up)
        self._kept: set[str] = set()  # taken back: stay here (pruned once they leave `engine.requests`)

    def pick(self, engine: Engine, pair: int, peer_waiting: int, peer_seen: int | None = None) -> list[list[Any]]:
        """Hand queued requests to `pair` while this queue is longer than the peer's: `peer_waiting` as its
        frame reported it, plus the requests handed to it that it had not received then (`peer_seen`: the
        entries it had received; None, a peer that does not report it: none counted in transit)."""
        sch, out = engine.scheduler, list[list[Any]]()
        self._kept.intersection_update(engine.requests)
        sent = self.sent.get(pair, 0)
        ahead = peer_waiting + (max(0, sent - peer_seen) if peer_seen is not None else 0)
        while sch.waiting and len(sch.waiting) > ahead + len(out) + 1:
            s = sch.waiting[-1]
            r = engine.requests.get(s.id)
            if s.generated or r is None or r.out or s.id in self._kept:
                break  # only requests with nothing generated: no KV, no tokens anywhere yet
            sch.finish(s.id)
            engine.requests.pop(s.id)
            p = r.params
            self.handed[f"pair{pair}/{r.id}"] = Handed(r.id, list(r.prompt), p, pair)
            timeline.mark("a-redirect", r.id, queue=len(sch.waiting))
            out.append([r.id, r.prompt, p.max_tokens, p.temperature, p.top_p, p.seed, list(p.stop_token_ids)]
                       + ([extras(p)] if extras(p) else []))
        self.total += len(out)
        self.sent[pair] = sent + len(out)
        return out

    def token(self, key: str, tok: int, eos: int | None) -> None:
        """A token sampled here for a pair row: a handed request's event (others: nothing to do)."""
        h = self.handed.get(key)
        if h is None:
            return
        h.out.append(tok)
        reason = ("stop" if stops_here(h.params, tok, eos, len(h.out))
                  else "length" if len(h.out) >= h.params.max_tokens else None)
        self.events.append(Event(h.rid, tok, reason is not None, reason))
        if reason:
            del self.handed[key]

    def ended(self, engine: Engine, key: str, why: str, gen: torch.Generator | None = None) -> None:
        """The peer ended (or refused) a handed request before it finished: take it back (module doc).
        `gen` is the generator A sampled its pair rows with (None: none drawn yet, or greedy)."""
        h = self.handed.pop(key, None)
        if h is None:
            return
        failed = requeue(engine, h.rid, h.prompt, h.params, h.out)
        if failed is not None:
            self.events.append(Event(h.rid, -1, True, f"error: {why}, and taking it back failed: {failed}"))
            return
        r = engine.requests[h.rid]
        if gen is not None and r.gen is not None:
            r.gen.set_state(gen.get_state())
        self._kept.add(h.rid)
        self.taken_back += 1
        log.info("took back %s after %d tokens: %s", h.rid, len(h.out), why)
        timeline.mark("a-took-back", h.rid, out=len(h.out))

    def close_pair(self, engine: Engine, pair: int) -> None:
        for key in [k for k, h in self.handed.items() if h.pair == pair]:
            self.ended(engine, key, "the live peer it was redirected to went away")
        self.aborts.pop(pair, None)
        self.sent.pop(pair, None)

    def abort(self, rid: str) -> None:
        """A's client went away: forget it here and tell the peer running it."""
        for key, h in list(self.handed.items()):
            if h.rid == rid:
                del self.handed[key]
                self.aborts.setdefault(h.pair, []).append(rid)

    def take_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev
