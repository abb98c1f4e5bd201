"""Decode under CUDA graphs, one graph per (batch-size bucket, page bucket); CUDA only, never on the CPU.

A decode step launches a few hundred small kernels whose launch cost, not their arithmetic, is the step's time
on a GPU. A CUDA graph replays all of them with one launch. Graphs need fixed shapes and fixed addresses, so a
step of `n` decodes is padded to the smallest batch bucket >= n (`bucket_for`; buckets 1, 2, 4, 8, then every 8
up to max_seqs, as vLLM does) and its block tables to a power of two of pages (`page_bucket`: the torch decode
path gathers whole pages, so the page count is part of the shape). Each (bucket, pages) graph is captured the
first time a step needs it and replayed after that.

Padding (`pad_decode`, pure and tested on the CPU): a padding row decodes token 0 at position 0 with a table of
page 0 only and one key; its K/V go to slot 0 of page 0 (the reserved page: every read of it is masked, see
kvcache.py) and its logits are dropped. A real row's inputs are exactly the eager step's, so its logits are too.

Data flow: Engine._logits on an all-decode step -> `DecodeGraphs.logits(ids, items)` -> `pad_decode` on the CPU
-> one copy into the graph's static inputs on the device -> replay (embed -> every layer -> head, with the
cache written in place) -> the first n rows of the static logits. None (the eager path runs) when graphs are
off, the step is not all decodes, n exceeds the largest bucket, or the model is tensor-parallel (its
all-reduce is outside the graph) or not complete. New weights (`LlamaModel.version`) drop every graph.
Every tensor made here names its device. UNVERIFIED on a GPU (none in development).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kascade_engine.batch.kvcache import DecodeGroup, ForwardBatch, KVCache
from kascade_engine.batch.model import LlamaModel

log = logging.getLogger(__name__)


def buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets for `max_seqs`: 1, 2, 4, 8, 16, 24, ... (every 8), always ending at max_seqs."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    out = [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs, 8))
    return (*out, max_seqs)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `n` rows; None when none does (the step runs eagerly)."""
    if n < 1:
        raise ValueError(f"a decode step has >= 1 row, got {n}")
    return next((b for b in sizes if b >= n), None)


def page_bucket(pages: int, max_pages: int) -> int:
    """Pages per block table in the graph: the next power of two >= `pages`, at most `max_pages`."""
    if not 1 <= pages <= max_pages:
        raise ValueError(f"pages {pages} outside 1..{max_pages}")
    return min(1 << (pages - 1).bit_length(), max_pages)


@dataclass(frozen=True)
class DecodeInputs:
    """A decode step's inputs padded to a graph's shape, on the CPU: `ids`, `positions`, `slots`, `lens` [bucket]
    and `tables` [bucket, pages]; rows 0..n-1 are the step's, the rest padding."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor
    n: int


def pad_decode(ids: list[int], items: list[tuple[list[int], int, int]], page_size: int, bucket: int,
               pages: int) -> DecodeInputs:
    """One decode per item (block table, start position, 1) -> the padded inputs of a (bucket, pages) graph.
    A real row: its token, position `start`, slot table[start // page_size] * page_size + start % page_size,
    `start + 1` keys, its table cut or padded (page 0) to `pages`. A padding row: token 0, position 0, slot 0,
    one key, a table of page 0."""
    n = len(items)
    if n != len(ids) or not 1 <= n <= bucket:
        raise ValueError(f"{len(ids)} ids for {n} decodes in a bucket of {bucket}")
    if any(k != 1 for _, _, k in items):
        raise ValueError("graphs run decode steps only (one new token per sequence)")
    cpu = torch.device("cpu")
    starts = [s for _, s, _ in items]
    if -(-(max(starts) + 1) // page_size) > pages:
        raise ValueError(f"a context of {max(starts) + 1} positions needs more than {pages} pages")
    pad = bucket - n
    tables = [t[:pages] + [0] * (pages - len(t[:pages])) for t, _, _ in items] + [[0] * pages] * pad
    slots = [t[s // page_size] * page_size + s % page_size for t, s, _ in items] + [0] * pad
    long = torch.long
    return DecodeInputs(torch.tensor(ids + [0] * pad, dtype=long, device=cpu),
                        torch.tensor(starts + [0] * pad, dtype=long, device=cpu),
                        torch.tensor(slots, dtype=long, device=cpu),
                        torch.tensor([s + 1 for s in starts] + [1] * pad, dtype=long, device=cpu),
                        torch.tensor(tables, dtype=long, device=cpu), n)


class _Graph:
    """One captured decode forward: static inputs on the device, the graph, its static logits [bucket, vocab]."""

    def __init__(self, static: DecodeInputs, graph: Any, logits: torch.Tensor) -> None:
        self.static, self.graph, self.out = static, graph, logits


def decode_forward(model: LlamaModel, cache: KVCache, x: DecodeInputs) -> torch.Tensor:
    """What a graph captures: embed -> every layer (the cache written at `x.slots`) -> logits [bucket, vocab]. The
    gather buffers are the graph's own (`private`): the cache's shared one may be reallocated by an eager step."""
    group = DecodeGroup(0, None, x.tables, x.lens, cache.page_size, pages=cache.page_gather(x.tables, private=True))
    batch = ForwardBatch(cache, x.positions, x.slots, decode=group)
    return model.logits(model.run_layers(0, model.shape.layers, model.embed(x.ids), batch))


class DecodeGraphs:
    """The engine's decode graphs (see the module docstring); `for_engine` returns None off CUDA. `plan` (which
    graph, padded inputs) runs anywhere; `_run` (capture, replay) needs CUDA."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_seqs: int, max_pages: int) -> None:
        self.model, self.cache = model, cache
        self.sizes = buckets(max_seqs)
        self.max_pages = max_pages
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._version = model.version
        # one memory pool shared by every graph: a graph's intermediates (and its output) may sit where another's
        # were, which is safe because graphs never run at once and a replay's logits are read (Engine._sample)
        # before the next replay; the static inputs are allocated outside the pool
        self._pool: Any = None

    @classmethod
    def for_engine(cls, model: LlamaModel, cache: KVCache, max_seqs: int, max_pages: int,
                   enabled: bool = True) -> DecodeGraphs | None:
        """The engine's graphs: None unless enabled on a CUDA device with the torch decode path."""
        from kascade_engine.batch import attention

        if not enabled or model.device.type != "cuda" or attention.backend(model.device) != "torch":
            return None  # FlashInfer's planned decode runs eagerly (its graph mode is not wired)
        return cls(model, cache, max_seqs, max_pages)

    def plan(self, ids: list[int], items: list[tuple[list[int], int, int]]) -> DecodeInputs | None:
        """The step's padded inputs, or None when no graph runs it (not all decodes, too many rows or pages,
        tensor parallel, or a model not complete)."""
        m = self.model
        if m.reduce is not None or not m.complete or not items or any(k != 1 for _, _, k in items):
            return None
        b = bucket_for(len(items), self.sizes)
        ps = self.cache.page_size
        need = max(-(-(s + 1) // ps) for _, s, _ in items)
        if b is None or need > self.max_pages:
            return None
        return pad_decode(ids, items, ps, b, page_bucket(need, self.max_pages))

    def logits(self, ids: list[int], items: list[tuple[list[int], int, int]]) -> torch.Tensor | None:
        """The step's logits [n, vocab] by a graph replay, or None: the eager path runs this step."""
        x = self.plan(ids, items)
        return None if x is None else self._run(x)[:x.n]

    def _run(self, x: DecodeInputs) -> torch.Tensor:
        """Replay the graph of `x`'s shape (captured first if new) on `x`: its static logits [bucket, vocab]."""
        if self.model.version != self._version:  # new weights: the addresses captured before are stale
            self._graphs.clear()
            self._version = self.model.version
        b, p = x.tables.shape
        g = self._graphs.get((b, p)) or self._capture(b, p)
        st = g.static
        for src, dst in ((x.ids, st.ids), (x.positions, st.positions), (x.slots, st.slots), (x.lens, st.lens),
                         (x.tables, st.tables)):
            dst.copy_(src)  # host -> the graph's device inputs, in stream order before the replay
        g.graph.replay()
        return g.out

    def _capture(self, b: int, p: int) -> _Graph:
        dev = self.model.device
        pad = pad_decode([0], [([0], 0, 1)], self.cache.page_size, b, p)  # every row padding: writes page 0 only
        static = DecodeInputs(pad.ids.to(device=dev), pad.positions.to(device=dev), pad.slots.to(device=dev),
                              pad.lens.to(device=dev), pad.tables.to(device=dev), n=b)
        side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture (allocator, lazy kernel loading)
            for _ in range(2):
                decode_forward(self.model, self.cache, static)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = decode_forward(self.model, self.cache, static)
        self._pool = graph.pool()
        log.info("captured a decode CUDA graph: batch %d, %d pages", b, p)
        g = self._graphs[b, p] = _Graph(static, graph, out)
        return g
