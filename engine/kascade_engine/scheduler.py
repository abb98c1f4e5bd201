"""Scheduler: continuous batching of prefill and decode, pure python (no torch).

Data flow: `add(seq)` queues a request -> `schedule()` picks the next step's batch: every running
sequence decodes one token (decode first: it keeps TBT low), then waiting sequences are admitted FCFS
for prefill while the batch stays within `max_batch_tokens` and `max_seqs` and the KV budget holds
their prompt plus output -> the executor runs the batch -> `finished(id)` retires a sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Seq:
    id: str
    prompt_len: int
    max_tokens: int
    generated: int = 0


@dataclass(frozen=True)
class Batch:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass
class Limits:
    max_batch_tokens: int = 512
    max_seqs: int = 16
    kv_tokens: int = 16384

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_seqs", "kv_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler limit {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Scheduler:
    limits: Limits = field(default_factory=Limits)
    waiting: deque[Seq] = field(default_factory=deque)
    running: dict[str, Seq] = field(default_factory=dict)

    def add(self, seq: Seq) -> None:
        need = seq.prompt_len + seq.max_tokens
        if need > self.limits.kv_tokens:
            raise ValueError(f"prompt_len + max_tokens = {need} exceeds the KV capacity of {self.limits.kv_tokens} tokens")
        if seq.prompt_len > self.limits.max_batch_tokens:
            raise ValueError(f"prompt of {seq.prompt_len} tokens exceeds max_batch_tokens {self.limits.max_batch_tokens}")
        self.waiting.append(seq)

    def kv_reserved(self) -> int:
        return sum(s.prompt_len + s.max_tokens for s in self.running.values())

    def schedule(self) -> Batch:
        decode = tuple(self.running)[: self.limits.max_seqs]
        budget = self.limits.max_batch_tokens - len(decode)
        seqs = len(decode)
        kv = self.kv_reserved()
        prefill: list[str] = []
        while self.waiting and seqs < self.limits.max_seqs:
            s = self.waiting[0]
            if s.prompt_len > budget or kv + s.prompt_len + s.max_tokens > self.limits.kv_tokens:
                break  # FCFS: never let a later, smaller request overtake the head
            self.waiting.popleft()
            prefill.append(s.id)
            self.running[s.id] = s
            budget -= s.prompt_len
            kv += s.prompt_len + s.max_tokens
            seqs += 1
        return Batch(tuple(prefill), decode)

    def token(self, seq_id: str) -> None:
        s = self.running.get(seq_id)
        if s is not None:
            s.generated += 1

    def finish(self, seq_id: str) -> None:
        self.running.pop(seq_id, None)
        self.waiting = deque(s for s in self.waiting if s.id != seq_id)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
