"""The persistent decode batch: an all-decode step's `ForwardBatch` kept on the device and advanced in place.

Steady decoding repeats the same rows step after step, each one position further on. Rebuilding the step's
metadata from Python lists every step (block tables [B, P] as a list of lists, positions, write slots, the key
mask) costs a host->device copy of the tables and ~20 torch ops; here, while the rows stay the same sequences
(the same block-table objects: a table list is a sequence's allocation, so identity is membership) and each is
exactly one position further on, the batch is advanced in place:
  positions, write slots and key counts   one `add_(1)` on a [3, B] tensor (they are rows of it)
  a row whose new token opens a page      its table entry and write slot set (one small index_put each)
  the key mask [B, 1, 1, P * page_size]   the new key of every row unmasked (one `scatter_`)
and the page-gather buffers and SDPA views (kvcache.PageGather) are made once per rebuild. Anything else
(another row set, a row not one step on, a context needing more pages than the tables hold) rebuilds
from the lists, as `kvcache.build_batch` does, with the same values. Not used with sliding-window page
reclaim (dropped pages change a table in place) nor for prefill chunks; `reset()` forgets the batch (the
engine calls it on every step that does not come here).

Data flow: Engine._hidden on an all-decode step -> `forward_batch(items)` -> the model runs it (its `rope` is
filled again each step: `rope` is reset here). Every tensor made here names the cache's device.
"""

from __future__ import annotations

import torch

from kascade_engine.batch.kvcache import DecodeGroup, ForwardBatch, KVCache, _tables
from kascade_engine.batch.model import inference


class DecodeBatch:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._tables: list[list[int]] = []  # the rows' block-table lists (held: their ids cannot be reused)
        self._ids: list[int] = []  # id() of each, the row set's identity
        self._starts: list[int] = []  # each row's position in the batch held now
        self._pages = 0  # entries per block table in the batch held now
        self._batch: ForwardBatch | None = None
        self._meta: torch.Tensor | None = None  # [3, B]: positions, write slots, key counts
        self._bias2d: torch.Tensor | None = None  # [B, P * page_size] view of the key mask
        self._pos_col: torch.Tensor | None = None  # [B, 1] view of the positions
        self.rebuilds = 0  # batches built from the lists (tests, benchmarks)
        self.advanced = False  # the last `forward_batch` advanced the batch in place (same rows, one step on)

    def reset(self) -> None:
        self.advanced = False
        if self._batch is not None:
            self._tables, self._ids, self._starts, self._batch = [], [], [], None

    @inference  # its tensors are inference tensors, written in place: always under inference mode
    def forward_batch(self, items: list[tuple[list[int], int, int]]) -> ForwardBatch:
        """The step's batch for `items` (block table, start, 1) per decode row, in row order."""
        tables = [t for t, _, _ in items]
        starts = [s for _, s, _ in items]
        ids = list(map(id, tables))
        b = self._batch
        if b is None or ids != self._ids or starts != [s + 1 for s in self._starts] or \
                max(starts) >= self._pages * self.cache.page_size:
            self.advanced = False
            return self._build(tables, ids, starts)
        self.advanced = True
        ps = self.cache.page_size
        opened = [i for i, s in enumerate(starts) if s % ps == 0]
        assert b.decode is not None and self._meta is not None and self._bias2d is not None
        assert self._pos_col is not None
        self._meta.add_(1)  # positions, slots and key counts are its rows
        if opened:  # the first slot of a new page: its table entry and its write slot
            dev = self.cache.device
            cols = [starts[i] // ps for i in opened]
            pages = [tables[i][c] for i, c in zip(opened, cols, strict=True)]
            idx = torch.tensor([opened, cols, pages], dtype=torch.long, device=dev)
            b.decode.tables.index_put_((idx[0], idx[1]), idx[2])
            b.slots.index_put_((idx[0],), idx[2] * ps)
        self._bias2d.scatter_(1, self._pos_col, 0.0)  # each row's new key (at its position) is seen
        b.rope, b.max_position = None, max(starts)
        b.decode.flash = None
        if len(b.decode._bias) > 1:  # sliding-window masks are built again from the new key counts
            b.decode._bias = {None: b.decode._bias[None]}
        self._starts = starts
        return b

    def _build(self, tables: list[list[int]], ids: list[int], starts: list[int]) -> ForwardBatch:
        """From the lists (the values `kvcache.build_batch` makes for these decodes)."""
        dev, ps = self.cache.device, self.cache.page_size
        pages = max(s // ps for s in starts) + 1
        t = _tables(tables, pages, dev)
        slots = [tab[s // ps] * ps + s % ps for tab, s in zip(tables, starts, strict=True)]
        meta = torch.tensor([starts, slots, [s + 1 for s in starts]], dtype=torch.long, device=dev)
        positions, slot_t, lens = meta.unbind(0)
        group = DecodeGroup(0, None, t, lens, ps)
        bias = group.bias_for(None, self.cache.dtype)  # [B, 1, 1, P * page_size], written in place from now on
        group.pages = self.cache.page_gather(t)
        self._batch = ForwardBatch(self.cache, positions, slot_t, decode=group, max_position=max(starts))
        self._meta, self._bias2d, self._pos_col = meta, bias.view(len(starts), -1), positions[:, None]
        self._tables, self._ids, self._starts, self._pages = tables, ids, starts, pages
        self.rebuilds += 1
        return self._batch
