"""KV cache: paged, preallocated on the engine's device, plus the per-step `ForwardBatch` that tells the
model where each token's K/V goes and which slots each query attends to.

Storage: `k`, `v` of shape [layers, pages * page_size, kv_heads, head_dim] (slot = page * page_size +
offset; page tables come from pages.PagePool). Memory is `torch.empty` (the OS maps it as it is used)
except slot 0, which stays zero: gathers pad with it, so padded keys are finite and masked out.

Data flow per step: block tables + (start, n) per sequence -> `build_batch` -> positions, write slots,
attention groups (all decodes in one SDPA call, all prefill chunks padded into another)
-> `LlamaModel.run_layers` writes each layer's new K/V with `write` and reads the group's context with
`gather`. A live split (live.py) keeps each side's KV in a private growable cache (`SequenceKV`): the
loading engine B holds layers 0..k-1, the full engine A layers k..L-1, and neither cache ever moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kascade_engine.batch.pages import PagePool


class KVCache:
    def __init__(self, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, reuse_gather: bool = False) -> None:
        self.layers, self.page_size, self.kv_heads, self.head_dim = layers, page_size, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        shape = (layers, pages * page_size, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()
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
        self.k = torch.cat((self.k, torch.empty(extra, dtype=self.dtype, device=self.device)), dim=1)
        self.v = torch.cat((self.v, torch.empty(extra, dtype=self.dtype, device=self.device)), dim=1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

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
        if self._gathered is None or self._gathered.shape[1] < n:
            self._gathered = torch.empty((2, n, width), dtype=self.dtype, device=self.device)
        out = self._gathered[:, :n]
        torch.index_select(self.k[layer].view(-1, width), 0, flat, out=out[0])
        torch.index_select(self.v[layer].view(-1, width), 0, flat, out=out[1])
        k, v = (x.view(B, C, self.kv_heads, self.head_dim).transpose(1, 2) for x in out)
        return k, v


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
class ForwardBatch:
    cache: KVCache
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] where each token's K/V is written
    groups: list[AttnGroup] = field(default_factory=list)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [N, head_dim], filled by the model


def _slots(table: list[int], start: int, n: int, page_size: int) -> list[int]:
    return [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]


def _group(members: list[tuple[int, list[int], int, int]], page_size: int, dev: torch.device) -> AttnGroup:
    """One SDPA call for `members` (first flat row, block table, start, n): queries padded to the
    longest chunk, keys to the longest context (padding keys read the zero slot and are masked)."""
    B, Q = len(members), max(n for _, _, _, n in members)
    C = max(start + n for _, _, start, n in members)
    P = -(-C // page_size)
    tables = torch.tensor([t[:P] + [0] * (P - len(t[:P])) for _, t, _, _ in members], dtype=torch.long, device=dev)
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


def build_batch(cache: KVCache, items: list[tuple[list[int], int, int]]) -> ForwardBatch:
    """`items`: (block table, start position, new tokens) per sequence, in flat row order. Attention
    runs as at most two SDPA calls per layer: every decode (n == 1) in one, every prefill chunk in
    the other (padded to the longest chunk), so the call count does not grow with the batch."""
    dev, ps = cache.device, cache.page_size
    positions: list[int] = []
    slots: list[int] = []
    decodes: list[tuple[int, list[int], int, int]] = []
    prefills: list[tuple[int, list[int], int, int]] = []
    row = 0
    for table, start, n in items:
        positions.extend(range(start, start + n))
        slots.extend(_slots(table, start, n, ps))
        (decodes if n == 1 else prefills).append((row, table, start, n))
        row += n
    batch = ForwardBatch(cache, torch.tensor(positions, dtype=torch.long, device=dev),
                         torch.tensor(slots, dtype=torch.long, device=dev))
    batch.groups = [_group(g, ps, dev) for g in (decodes, prefills) if g]
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
