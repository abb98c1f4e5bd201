"""KV cache: paged, preallocated on the engine's device, plus the per-step `ForwardBatch` that tells the
model where each token's K/V goes and which slots each query attends to.

Storage: `k`, `v` of shape [layers, pages * page_size, kv_heads, head_dim] (slot = page * page_size +
offset; page tables come from pages.PagePool). Memory starts zero (`zeroed`: on the CPU the OS maps it as
it is used); page 0 is never handed out and holds only finite values (zero, or the K/V of a CUDA graph's
padding rows, graphs.py): gathers pad with it, and every read of it is masked out.

Data flow per step: block tables + (start, n) per sequence -> `build_batch` -> positions, write slots,
attention groups (all decodes in one SDPA call, all prefill chunks padded into another)
-> `LlamaModel.run_layers` writes each layer's new K/V with `write` and reads the group's context with
`gather`. A live split (live.py) keeps each side's KV in a private growable cache (`SequenceKV`): the
loading engine B holds layers 0..k-1, the full engine A layers k..L-1, and neither cache ever moves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kascade_engine.batch.pages import PagePool


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU from calloc'd memory (numpy), so the OS maps pages only as they are written
    (a large cache costs nothing until used). Zero K/V matter: decode attention reads whole pages, and a slot
    not yet written must be finite (0 * NaN is NaN even under a -inf mask)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


def kv_tokens_for_memory(free: int, total: int, utilization: float, weight_bytes: int, bytes_per_token: int,
                         page_size: int) -> int:
    """KV capacity (tokens, whole pages) for a device with `free` of `total` bytes free now, of which
    `utilization` may hold this engine's weights (`weight_bytes`, possibly not loaded yet) and KV cache; what
    others use already is never counted on. ValueError when nothing is left for one page."""
    budget = min(free, int(total * utilization) - (total - free)) - weight_bytes
    tokens = budget // bytes_per_token // page_size * page_size
    if tokens < page_size:
        raise ValueError(f"--gpu-memory-utilization {utilization}: {free / 2**30:.2f} GiB free of "
                         f"{total / 2**30:.2f} GiB leaves no KV cache after {weight_bytes / 2**30:.2f} GiB of weights")
    return tokens


class KVCache:
    def __init__(self, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, reuse_gather: bool = False) -> None:
        self.layers, self.page_size, self.kv_heads, self.head_dim = layers, page_size, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        shape = (layers, pages * page_size, kv_heads, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        self._views()
        # `gather` writes into one buffer kept across calls (the engine's cache: reuse_gather) instead of two fresh
        # tensors per call; the views it returns are valid until the next gather
        self.reuse_gather = reuse_gather
        self._gathered: torch.Tensor | None = None

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def grow(self, pages: int) -> None:
        """Append `pages` pages (private split caches only; the engine's cache never grows)."""
        extra = (self.layers, pages * self.page_size, self.kv_heads, self.head_dim)
        self.k = torch.cat((self.k, zeroed(extra, self.dtype, self.device)), dim=1)
        self.v = torch.cat((self.v, zeroed(extra, self.dtype, self.device)), dim=1)
        self._views()

    def _views(self) -> None:
        """Per-layer views made once (a step indexes them instead of slicing the cache per layer and call): slot
        rows [slots, kv_heads, head_dim] for writes, page rows [pages, page_size * kv_heads * head_dim] for reads."""
        self._k, self._v = self.k.unbind(0), self.v.unbind(0)
        width = self.page_size * self.kv_heads * self.head_dim
        self._kp = tuple(x.view(-1, width) for x in self._k)
        self._vp = tuple(x.view(-1, width) for x in self._v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k[layer].index_copy_(0, slots, k)
        self._v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`index` [B, C] slot ids -> K, V [B, kv_heads, C, head_dim].

        This copy is most of a long-context decode step on CPU (every context position of every sequence, per
        layer). Rows are copied as [slots, kv_heads * head_dim] into a buffer kept from call to call (grown to
        the largest gather, never shrunk): fresh output tensors cost a page fault or a cold write per page every
        step. Measured (one core, micro-benchmark alternated twice): a decode step of 16 sequences
        at ~390 positions 137-138 ms -> 82-86 ms, with a 16-token chunk 183 ms -> 92-97 ms."""
        B, C = index.shape
        flat = index.reshape(-1)
        n, width = flat.numel(), self.kv_heads * self.head_dim
        if not self.reuse_gather:
            k = self.k[layer].view(-1, width).index_select(0, flat).view(B, C, self.kv_heads, self.head_dim)
            v = self.v[layer].view(-1, width).index_select(0, flat).view(B, C, self.kv_heads, self.head_dim)
            return k.transpose(1, 2), v.transpose(1, 2)
        if self._gathered is None or self._gathered.numel() < 2 * n * width:
            self._gathered = torch.empty((2, n * width), dtype=self.dtype, device=self.device)
        out = self._gathered.view(-1)[:2 * n * width].view(2, n, width)
        torch.index_select(self.k[layer].view(-1, width), 0, flat, out=out[0])
        torch.index_select(self.v[layer].view(-1, width), 0, flat, out=out[1])
        k, v = (x.view(B, C, self.kv_heads, self.head_dim).transpose(1, 2) for x in out)
        return k, v

    def gather_pages(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tables` [B, P] page ids -> K, V [B, P * page_size, kv_heads, head_dim]: whole pages copied (one
        contiguous run of page_size * kv_heads * head_dim values each, no per-token index), into the buffer
        kept from call to call when `reuse_gather` (valid until the next gather)."""
        pg = self.page_gather(tables)
        self.gather_into(layer, pg)
        return pg.k.view(pg.shape), pg.v.view(pg.shape)

    def page_gather(self, tables: torch.Tensor, private: bool = False) -> PageGather:
        """The destination of a step's page gathers, made once per step and reused by every layer (`gather_into`):
        the buffer kept from call to call when `reuse_gather`, else (or `private`: a CUDA graph's own) a fresh one."""
        B, P = tables.shape
        flat = tables.reshape(-1)
        n, width = flat.numel(), self.page_size * self.kv_heads * self.head_dim
        if private or not self.reuse_gather:
            buf = torch.empty((2, n, width), dtype=self.dtype, device=self.device)
        else:
            if self._gathered is None or self._gathered.numel() < 2 * n * width:
                self._gathered = torch.empty((2, n * width), dtype=self.dtype, device=self.device)
            buf = self._gathered.view(-1)[:2 * n * width].view(2, n, width)
        shape = (B, P * self.page_size, self.kv_heads, self.head_dim)
        k, v = buf.unbind(0)
        return PageGather(flat, k, v, shape, k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def gather_into(self, layer: int, pg: PageGather) -> None:
        """Layer `layer`'s pages of `pg.flat` into `pg`'s buffers (two copies, nothing allocated)."""
        torch.index_select(self._kp[layer], 0, pg.flat, out=pg.k)
        torch.index_select(self._vp[layer], 0, pg.flat, out=pg.v)


@dataclass(frozen=True)
class PageGather:
    """Where a step's decode pages land: `k`, `v` [B * P, page_size * kv_heads * head_dim] (one row per page),
    seen as `kt`, `vt` [B, kv_heads, P * page_size, head_dim] (what SDPA reads). Valid until the cache's next
    gather into the same buffer (the next step's `page_gather`, or a gather of a prefill group)."""

    flat: torch.Tensor  # [B * P] page ids
    k: torch.Tensor
    v: torch.Tensor
    shape: tuple[int, int, int, int]  # [B, P * page_size, kv_heads, head_dim]
    kt: torch.Tensor
    vt: torch.Tensor


@dataclass
class AttnGroup:
    """`batch` sequences x `q_len` query slots (shorter chunks padded) attend to `index` under `mask`.

    `src` [batch * q_len] picks each query slot's row of the step's flat [N] tokens (padding repeats a
    real row; its output is dropped); `keep` are the slots holding real tokens and `dest` their rows in
    the flat output. When the group is exactly rows `rows[0]..rows[1]` in order with no padding, `src`,
    `keep` and `dest` are None and the rows are sliced instead (all decodes, or one prefill chunk)."""

    rows: tuple[int, int]
    batch: int
    q_len: int
    index: torch.Tensor  # [B, C] slot ids
    mask: torch.Tensor  # [B, 1, q_len, C] True = attend
    qpos: torch.Tensor  # [B, q_len] position of each query slot
    src: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    dest: torch.Tensor | None = None
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The causal mask, narrowed to the last `window` positions per query (sliding-window layers);
        built once per step and window, shared by every layer with that window."""
        if window is None:
            return self.mask
        m = self._windowed.get(window)
        if m is None:
            keys = torch.arange(self.mask.shape[-1], dtype=torch.long, device=self.mask.device)
            recent = keys[None, None, :] > (self.qpos[:, :, None] - window)  # [B, q_len, C]
            m = self._windowed[window] = self.mask & recent[:, None]
        return m


@dataclass
class DecodeGroup:
    """Every decode of the step (one query each) attending over whole pages of its block table, read
    straight from the cache's page view: no per-token index, no boolean mask.

    `rows` [B] are the decodes' rows in the step's flat tokens (None: rows `first..first+B-1` in order),
    `tables` [B, P] their block tables (0: padding or a page dropped outside a sliding window; page 0 is
    zero), `lens` [B] keys per sequence (its context including the new token). `bias_for(window)` is the
    additive key mask [B, 1, 1, P * page_size] (0 visible, -inf hidden), built once per step and window."""

    first: int
    rows: torch.Tensor | None
    tables: torch.Tensor
    lens: torch.Tensor
    page_size: int
    _bias: dict[int | None, torch.Tensor] = field(default_factory=dict)
    flash: dict[int | None, Any] | None = None  # FlashInfer wrappers planned for this step, per window (CUDA)
    pages: PageGather | None = None  # the gather's destination, made at the step's first layer (torch path)

    @property
    def batch(self) -> int:
        return int(self.tables.shape[0])

    def bias_for(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        b = self._bias.get(window)
        if b is None:
            keys = torch.arange(self.tables.shape[1] * self.page_size, dtype=torch.long, device=self.lens.device)
            seen = keys[None, :] < self.lens[:, None]
            if window is not None:  # query at lens - 1 sees keys in (lens - 1 - window, lens - 1]
                seen &= keys[None, :] > (self.lens[:, None] - 1 - window)
            b = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
            b = self._bias[window] = b[:, None, None, :]
        return b


@dataclass
class ForwardBatch:
    cache: KVCache
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] where each token's K/V is written
    groups: list[AttnGroup] = field(default_factory=list)  # prefill chunks (padded SDPA groups)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [N, head_dim], filled by the model
    decode: DecodeGroup | None = None  # every decode of the step
    fresh: bool = False  # the step is one prompt from position 0: causal attention over its own K/V
    # the highest position of the step when known on the host (the model then reads rotary cos/sin from its
    # table, grown to cover it); None: computed from `positions` on the device (a CUDA graph's batch)
    max_position: int | None = None


def _group(members: list[tuple[int, list[int], int, int]], page_size: int, dev: torch.device) -> AttnGroup:
    """One SDPA call for `members` (first flat row, block table, start, n): queries padded to the
    longest chunk, keys to the longest context (padding keys read the zero slot and are masked)."""
    B, Q = len(members), max(n for _, _, _, n in members)
    C = max(start + n for _, _, start, n in members)
    P = -(-C // page_size)
    tables = _tables([t for _, t, _, _ in members], P, dev)
    starts = torch.tensor([start for _, _, start, _ in members], dtype=torch.long, device=dev)
    ns = torch.tensor([n for _, _, _, n in members], dtype=torch.long, device=dev)
    keys = torch.arange(C, dtype=torch.long, device=dev)
    qs = torch.arange(Q, dtype=torch.long, device=dev)
    real = qs[None, :] < ns[:, None]  # [B, Q] query slots holding a token
    # a padded query slot takes its sequence's last position: it sees real keys only, never none (NaN)
    qpos = starts[:, None] + torch.minimum(qs[None, :], ns[:, None] - 1)
    mask = keys[None, None, :] <= qpos[:, :, None]  # causal; padding keys lie beyond every query
    valid = keys[None, :] < (starts + ns)[:, None]
    page = tables[:, keys // page_size]  # 0: padding, or a page dropped outside a sliding window
    index = torch.where(valid & (page > 0), page * page_size + keys % page_size, 0)
    first = members[0][0]
    contiguous = all(row == first + i * Q for i, (row, _, _, n) in enumerate(members)) and bool(real.all())
    if contiguous:
        return AttnGroup((first, first + B * Q), B, Q, index, mask.view(B, 1, Q, C), qpos)
    firsts = torch.tensor([row for row, _, _, _ in members], dtype=torch.long, device=dev)
    src = torch.where(real, firsts[:, None] + qs[None, :], firsts[:, None]).view(-1)
    keep = real.view(-1).nonzero().view(-1)
    return AttnGroup((first, first), B, Q, index, mask.view(B, 1, Q, C), qpos, src, keep, src.index_select(0, keep))


def _tables(tables: list[list[int]], pages: int, dev: torch.device) -> torch.Tensor:
    """Block tables cut or padded (page 0) to `pages` entries -> [B, pages] on `dev` (one list per sequence)."""
    return torch.tensor([t[:pages] + [0] * (pages - len(t[:pages])) for t in tables], dtype=torch.long, device=dev)


def build_batch(cache: KVCache, items: list[tuple[list[int], int, int]]) -> ForwardBatch:
    """`items`: (block table, start position, new tokens) per sequence, in flat row order.

    Built once per step as tensors (no per-token Python lists): positions and write slots from the block
    tables, every decode (n == 1) in one `DecodeGroup` over whole pages, every prefill chunk in one padded
    SDPA group, so the attention call count does not grow with the batch. A step that is a single prompt from
    position 0 is marked `fresh` (the model runs causal attention on the chunk's own K/V, nothing gathered)."""
    dev, ps = cache.device, cache.page_size
    starts_l = [start for _, start, _ in items]
    ns_l = [n for _, _, n in items]
    pages = max(-(-(s + n) // ps) for s, n in zip(starts_l, ns_l, strict=True))
    tables = _tables([t for t, _, _ in items], pages, dev)
    starts = torch.tensor(starts_l, dtype=torch.long, device=dev)
    if max(ns_l) == 1:  # decodes only: one row per sequence
        positions = starts
        seq_tables = tables
    else:
        ns = torch.tensor(ns_l, dtype=torch.long, device=dev)
        seq = torch.repeat_interleave(torch.arange(len(items), dtype=torch.long, device=dev), ns)
        first = torch.cumsum(ns, 0) - ns
        positions = starts[seq] + torch.arange(seq.numel(), dtype=torch.long, device=dev) - first[seq]
        seq_tables = tables[seq]
    page = seq_tables.gather(1, (positions // ps)[:, None])[:, 0]
    batch = ForwardBatch(cache, positions, page * ps + positions % ps,
                         max_position=max(s + n for s, n in zip(starts_l, ns_l, strict=True)) - 1)
    rows = list(itertools.accumulate(ns_l, initial=0))
    dec = [i for i, n in enumerate(ns_l) if n == 1]
    if dec:
        if len(dec) == len(items):
            batch.decode = DecodeGroup(0, None, tables, starts + 1, ps)
        else:
            idx = torch.tensor(dec, dtype=torch.long, device=dev)
            d_pages = max(-(-(starts_l[i] + 1) // ps) for i in dec)
            contiguous = dec == list(range(dec[0], dec[0] + len(dec)))
            batch.decode = DecodeGroup(rows[dec[0]], None if contiguous else torch.tensor(
                [rows[i] for i in dec], dtype=torch.long, device=dev), tables[idx, :d_pages], starts[idx] + 1, ps)
    pre = [(rows[i], t, s, n) for i, (t, s, n) in enumerate(items) if n > 1]
    if pre:
        batch.groups = [_group(pre, ps, dev)]
    batch.fresh = len(items) == 1 and starts_l[0] == 0
    return batch


class SequenceKV:
    """One sequence's KV in its own small growable paged cache, per layer range (live split)."""

    def __init__(self) -> None:
        self.cache: KVCache | None = None
        self.pool: PagePool | None = None
        self.lengths: dict[int, int] = {}  # positions held, per layer written here

    @property
    def layers(self) -> set[int]:
        return set(self.lengths)

    def tokens(self) -> int:
        return max(self.lengths.values(), default=0)

    def batch(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
              a: int, b: int, start: int, n: int) -> ForwardBatch:
        """A one-sequence batch writing positions start..start+n of layers a..b-1 (checked contiguous)."""
        layers, kv_heads, head_dim = shape
        for i in range(a, b):
            have = self.lengths.get(i, 0)
            if start != have:
                raise RuntimeError(f"layer {i}: KV holds {have} positions, new tokens start at {start}")
        if self.cache is None or self.pool is None:
            self.pool = PagePool(2, 16)
            self.cache = KVCache(layers, 2, 16, kv_heads, head_dim, dtype, device)
        while not self.pool.grow("seq", start + n):
            more = max(self.pool.pages, self.pool.missing("seq", start + n))
            self.pool.add_pages(more)
            self.cache.grow(more)
        return build_batch(self.cache, [(self.pool.tables["seq"], start, n)])

    def commit(self, a: int, b: int, end: int) -> None:
        for i in range(a, b):
            self.lengths[i] = end
