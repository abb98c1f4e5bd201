"""The engine core: one model, its scheduler, and the per-request state (tokens, KV cache).

Data flow: `submit(prompt_ids, params)` -> scheduler queue -> `step()` runs one continuous-batching
step (decode of every running sequence, prefill of newly admitted ones; each sequence is executed on
its own because sequences differ in length, the batch boundary is the scheduler's) -> `Event`s
(request id, token, finished) -> the server streams them. `load_blocks` makes blocks resident one by
one, so the engine knows at each instant which prefix of layers it can run live.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kascade_engine.kvcache import SequenceKV
from kascade_engine.model import LlamaModel
from kascade_engine.sampling import SamplingParams, sample
from kascade_engine.scheduler import Limits, Scheduler, Seq

log = logging.getLogger(__name__)


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    out: list[int] = field(default_factory=list)
    kv: SequenceKV = field(default_factory=SequenceKV)
    first_token_at: float | None = None
    gen: torch.Generator | None = None


@dataclass(frozen=True)
class Event:
    request: str
    token: int
    finished: bool
    reason: str | None = None  # "stop" | "length" | "error: <message>" (token -1)


class Engine:
    def __init__(self, model: LlamaModel, limits: Limits | None = None, eos: int | None = None) -> None:
        self.model = model
        self.scheduler = Scheduler(limits or Limits())
        self.requests: dict[str, Request] = {}
        self.eos = eos
        self._ids = itertools.count()
        self._aborts: set[str] = set()

    def reset(self) -> None:
        """Forget every request (release: the instance holds nothing afterwards)."""
        for rid in list(self.requests):
            self.scheduler.finish(rid)
        self.requests.clear()

    def load_blocks(self, blocks: Iterable[Any]) -> None:
        for b in blocks:
            self.model.add_block(b.id, b.tensors())

    def submit(self, prompt: list[int], params: SamplingParams, rid: str | None = None) -> str:
        if not prompt:
            raise ValueError("prompt is empty")
        rid = rid or f"req-{next(self._ids)}"
        self.scheduler.add(Seq(rid, len(prompt), params.max_tokens))
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.requests[rid] = Request(rid, list(prompt), params, gen=gen)
        return rid

    def abort(self, rid: str) -> None:
        """Safe from another thread while `step` runs: applied at the start of the next step."""
        self._aborts.add(rid)

    def _forward(self, r: Request, ids: list[int], start: int) -> int:
        m = self.model
        h = m.run_layers(0, m.shape.layers, m.embed(torch.tensor(ids, device=m.device)), r.kv, start)
        return sample(m.logits(h[-1:])[0], r.params, r.gen)

    def step(self) -> list[Event]:
        while self._aborts:
            rid = self._aborts.pop()
            self.scheduler.finish(rid)
            self.requests.pop(rid, None)
        batch = self.scheduler.schedule()
        events: list[Event] = []
        for rid in (*batch.decode, *batch.prefill):
            r = self.requests.get(rid)
            if r is None:
                continue
            try:
                if r.out:
                    tok = self._forward(r, [r.out[-1]], len(r.prompt) + len(r.out) - 1)
                else:
                    tok = self._forward(r, r.prompt, 0)
                    r.first_token_at = time.monotonic()
            except (RuntimeError, ValueError, IndexError) as e:  # fails this request only
                log.warning("request %s failed: %s", rid, e)
                self.scheduler.finish(rid)
                self.requests.pop(rid, None)
                events.append(Event(rid, -1, True, f"error: {e}"))
                continue
            r.out.append(tok)
            self.scheduler.token(rid)
            reason = None
            if tok == self.eos or tok in r.params.stop_token_ids:
                reason = "stop"
            elif len(r.out) >= r.params.max_tokens:
                reason = "length"
            events.append(Event(rid, tok, reason is not None, reason))
            if reason:
                self.scheduler.finish(rid)
                self.requests.pop(rid, None)
        return events

    def generate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """Run one request to completion (tests, benchmarks)."""
        rid = self.submit(prompt, params)
        out: list[int] = []
        while True:
            for e in self.step():
                if e.request == rid:
                    if e.token < 0:
                        raise RuntimeError(f"generation failed: {e.reason}")
                    out.append(e.token)
                    if e.finished:
                        return out
