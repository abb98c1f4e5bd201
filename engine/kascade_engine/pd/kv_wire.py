"""KV wire: the frames a prefill engine P and a decode engine D exchange to move one request's KV cache
(disaggregated serving), their checks, and the running digest both ends keep.

Session (one authenticated data-plane connection D -> P, opened through the same hello as activation
connections and reused for the next request once this one is done):
  D -> P  {"op": "prefill", "req", "tokens": [...], "params": {temperature, top_p, seed, extras},
           "layers", "kv_heads", "head_dim", "dtype",          (D's model shape: P refuses a mismatch)
           "waited_s" (optional),                             how long the prompt already waited before this
                                                              op (a converted decoder's hand-back): P queues
                                                              it by that arrival, not at the back (PrefillOp)
           "fallback" (optional)}                             host:port of the prefill engine D goes to if P
                                                              hands the prompt back (P: a converted decoder)
  P -> D  {"op": "kv", "req", "layer", "start", "n", "part": "k"|"v", "shape": [n, kv_heads, head_dim],
           "dtype"} + raw bytes (row-major, little endian)    one pair of frames per layer per prefill
                                                              chunk, sent while P computes the next layer
  P -> D  {"op": "kv_done", "req", "token" (the first sampled token), "frames", "bytes", "digest",
           "rate" (optional)}                                 P's measured prefill rate, prompt tokens/s (its
                                                              velocity meter): D's estimate of a prompt's time
                                                              behind the ones it has queued there (pace)
     or   {"op": "error", "req", "message"}
     or   {"op": "handback", "req", "message"}                 P is a converted decoder whose budget leaves the
                                                              prompt no progress (handback.py's rule): D
                                                              prefills it on its fallback, or itself
D accepts the KV only if every (layer, position) of the prompt arrived exactly once and the byte count
and blake2b digest over the payloads (in send order) match; otherwise it prefills locally instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

Header = dict[str, Any]
PARTS = ("k", "v")


class KVWireError(ValueError):
    """A malformed or inconsistent KV frame; the message names the field."""


def digest() -> Any:
    return hashlib.blake2b(digest_size=16)


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the prefix ("float32", "bfloat16", ...)
    itemsize: int

    def frame_bytes(self, n: int) -> int:
        """Bytes of one part (K or V) of `n` positions of one layer."""
        return n * self.kv_heads * self.head_dim * self.itemsize

    def to_header(self) -> Header:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}

    def mismatch(self, h: Header) -> str | None:
        """Why a peer's announced shape cannot use our KV (None when it can)."""
        for name, mine in self.to_header().items():
            if h.get(name) != mine:
                return f"field '{name}': peer has {h.get(name)!r}, this engine has {mine!r}"
        return None


@dataclass(frozen=True)
class PrefillOp:
    """D -> P: prefill `tokens` and ship their KV. `waited_s`: the seconds the prompt already waited for a
    prefill before this op (0 for a prompt sent on arrival; a converted decoder that hands a prompt back sends
    its time there), so P queues it by its arrival (`now - waited_s`, on P's own clock: no clock is shared)
    instead of at the back, behind prompts that reached the router after it. `fallback`: the prefill engine D
    sends the prompt to if P (then a converted decoder) hands it back; P judges its own pace against what a
    prefill there takes (handback.HandBack.watch_served)."""

    req: str
    tokens: list[int]
    temperature: float
    top_p: float
    seed: int | None
    shape: KVShape
    waited_s: float = 0.0
    fallback: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # sampling.extras: penalties, min_tokens, top_k...

    def to_header(self) -> Header:
        h: Header = {"op": "prefill", "req": self.req, "tokens": self.tokens,
                     "params": {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                                **self.extras},
                     **self.shape.to_header()}
        if self.waited_s > 0:
            h["waited_s"] = self.waited_s
        if self.fallback is not None:
            h["fallback"] = self.fallback
        return h


def waited_s(h: Header) -> float:
    """A prefill op's `waited_s` (0 when absent), checked: a finite number >= 0."""
    v = h.get("waited_s", 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise KVWireError(f"prefill field 'waited_s' = {v!r}: must be a finite number of seconds >= 0")
    return float(v)


def fallback(h: Header) -> str | None:
    """A prefill op's `fallback` (None when absent), checked: host:port."""
    v = h.get("fallback")
    if v is None:
        return None
    host, _, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KVWireError(f"prefill field 'fallback' = {v!r}: expected host:port")
    return str(v)


def pace(h: Header) -> float | None:
    """A kv_done's `rate` (None when absent: P has not measured its prefill rate yet), checked: a finite number of
    prompt tokens/s > 0."""
    v = h.get("rate")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise KVWireError(f"kv_done field 'rate' = {v!r}: must be a finite number of prompt tokens/s > 0")
    return float(v)


def kv_header(req: str, layer: int, start: int, n: int, part: str, shape: KVShape) -> Header:
    return {"op": "kv", "req": req, "layer": layer, "start": start, "n": n, "part": part,
            "shape": [n, shape.kv_heads, shape.head_dim], "dtype": shape.dtype}


def _int(h: Header, name: str, lo: int, hi: int) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise KVWireError(f"kv frame field '{name}' = {v!r}: must be an int in {lo}..{hi}")
    return v


def check_kv(h: Header, shape: KVShape, prompt_len: int, payload: int) -> tuple[int, int, int, str]:
    """(layer, start, n, part) of a KV frame, after checking it against the request and our model."""
    layer = _int(h, "layer", 0, shape.layers - 1)
    start = _int(h, "start", 0, prompt_len - 1)
    n = _int(h, "n", 1, prompt_len - start)
    part = h.get("part")
    if part not in PARTS:
        raise KVWireError(f"kv frame field 'part' = {part!r}: must be 'k' or 'v'")
    if h.get("dtype") != shape.dtype:
        raise KVWireError(f"kv frame field 'dtype' = {h.get('dtype')!r}: this engine's KV is {shape.dtype}")
    if h.get("shape") != [n, shape.kv_heads, shape.head_dim]:
        raise KVWireError(
            f"kv frame field 'shape' = {h.get('shape')!r}: expected {[n, shape.kv_heads, shape.head_dim]}"
        )
    if payload != shape.frame_bytes(n):
        raise KVWireError(f"kv frame payload is {payload} bytes; {n} positions need {shape.frame_bytes(n)}")
    return layer, start, n, str(part)


@dataclass
class Coverage:
    """Which (part, layer, position) of a prompt's KV arrived; each exactly once."""

    layers: int
    positions: int
    seen: dict[tuple[str, int], list[bool]] = field(default_factory=dict)
    frames: int = 0

    def add(self, part: str, layer: int, start: int, n: int) -> None:
        row = self.seen.setdefault((part, layer), [False] * self.positions)
        if any(row[start:start + n]):
            raise KVWireError(f"kv frame for layer {layer} part {part} positions {start}..{start + n - 1} "
                              "overlaps KV already received")
        row[start:start + n] = [True] * n
        self.frames += 1

    def missing(self) -> str | None:
        for part in PARTS:
            for layer in range(self.layers):
                row = self.seen.get((part, layer))
                if row is None or not all(row):
                    got = 0 if row is None else sum(row)
                    return f"layer {layer} part {part}: {got}/{self.positions} positions received"
        return None
