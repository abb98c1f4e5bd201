"""Attention over the paged KV cache, per layer, for one step's `ForwardBatch` (kvcache.py).

Three shapes of work, each with its kernel:
  decodes (one query per sequence)   `decode`: whole pages of each block table copied page by page (no
                                     per-token index) into buffers and views made once per step, SDPA with
                                     the query heads of a KV head as its query length (GQA folded: B *
                                     kv_heads items, not B * heads) and an additive key mask built once per step
                                     (measured on CPU: as fast as or faster than a per-token gather with a
                                     boolean mask, and far faster than matmul + softmax, which copies K to
                                     transpose it). On CUDA with FlashInfer importable, its paged decode
                                     kernel reads the pages in place: nothing gathered.
  one prompt from position 0         `fresh`: SDPA with `is_causal` on the chunk's own K/V (nothing gathered;
                                     flash / memory-efficient kernels on CUDA, GQA native)
  prefill chunks with a context      `padded`: the chunks padded into one SDPA call with a boolean mask over
                                     their gathered contexts (kvcache.AttnGroup)

Data flow: q [N, heads, head_dim] (rotary applied, this layer's K/V already written) -> per group of the step
-> out [N, heads * head_dim] in the step's row order. Every tensor made here names the cache's device.
The FlashInfer path is UNVERIFIED on a GPU (none in development): written against flashinfer >= 0.2's
`BatchDecodeWithPagedKVCacheWrapper.plan/run`; `backend()` reports which path runs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from kascade_engine.batch.kvcache import AttnGroup, DecodeGroup, ForwardBatch


def backend(device: torch.device) -> str:
    """The decode attention kernel this device gets: "flashinfer" (CUDA, installed) or "torch"."""
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def decode(q: torch.Tensor, batch: ForwardBatch, g: DecodeGroup, layer: int, window: int | None) -> torch.Tensor:
    """q [B, heads, head_dim] of the step's decodes -> [B, heads * head_dim]."""
    cache = batch.cache
    B, H, D = q.shape
    if g.flash is not None:
        return flashinfer_decode(g, q, cache.k[layer], cache.v[layer], cache.page_size, window)
    if g.pages is None:  # once per step: every layer gathers into the same buffers and views
        g.pages = cache.page_gather(g.tables)
    pg = g.pages
    cache.gather_into(layer, pg)
    kv = pg.kt.shape[1]
    # grouped-query attention folded into the query length: query heads kv*g..kv*g+g-1 share kv head kv
    # (transformers' repeat_interleave), so SDPA runs B * kv_heads items of g queries, not B * heads of one
    o = F.scaled_dot_product_attention(q.reshape(B, kv, H // kv, D), pg.kt, pg.vt,
                                       attn_mask=g.bias_for(window, q.dtype))
    return o.reshape(B, H * D)  # [B, kv_heads, g, D]: heads in order


def fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One prompt from position 0: q [N, heads, D], its own k, v [N, kv_heads, D] -> [N, heads * D]."""
    N, H, D = q.shape
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=k.shape[1] != H)
    return o[0].transpose(0, 1).reshape(N, H * D)


def padded(flat: torch.Tensor, batch: ForwardBatch, g: AttnGroup, layer: int, window: int | None,
           heads: int) -> torch.Tensor:
    """Prefill chunks with their contexts: flat [N, heads * D] -> [g.batch * g.q_len, heads * D] (padding kept)."""
    k, v = batch.cache.gather(layer, g.index)
    width = flat.shape[1]
    r0, r1 = g.rows
    qg = flat[r0:r1] if g.src is None else flat.index_select(0, g.src)
    qg = qg.view(g.batch, g.q_len, heads, width // heads).transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask_for(window), enable_gqa=heads != k.shape[1])
    return o.transpose(1, 2).reshape(g.batch * g.q_len, width)


_WRAPPERS: dict[tuple[torch.device, int | None], Any] = {}


def plan_flashinfer(g: DecodeGroup, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    windows: tuple[int | None, ...]) -> None:
    """CUDA + FlashInfer: plan the step's paged decode once (page indptr / indices / last page length), per
    distinct window; every layer's `run` reuses it. UNVERIFIED on a GPU."""
    import flashinfer

    dev = g.tables.device
    ps = g.page_size
    used = (g.lens + ps - 1) // ps  # pages each sequence reads
    indptr = torch.zeros(g.batch + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(used, 0)
    cols = torch.arange(g.tables.shape[1], device=dev)
    indices = g.tables[cols[None, :] < used[:, None]].to(torch.int32)
    last = ((g.lens - 1) % ps + 1).to(torch.int32)
    g.flash = {}
    for w in set(windows):
        wrapper = _WRAPPERS.get((dev, w))
        if wrapper is None:  # one workspace and wrapper per device and window, planned again every step
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
            wrapper = _WRAPPERS[dev, w] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(indptr, indices, last, heads, kv_heads, head_dim, ps, pos_encoding_mode="NONE",
                     window_left=-1 if w is None else w - 1, q_data_type=dtype, kv_data_type=dtype)
        g.flash[w] = wrapper


def flashinfer_decode(g: DecodeGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int,
                      window: int | None) -> torch.Tensor:
    """The planned FlashInfer decode over this layer's pages, read in place. UNVERIFIED on a GPU."""
    assert g.flash is not None
    wrapper: Any = g.flash[window]
    B, H, D = q.shape
    pages = (k.view(-1, page_size, k.shape[1], D), v.view(-1, page_size, v.shape[1], D))
    return wrapper.run(q.contiguous(), pages).reshape(B, H * D)  # type: ignore[no-any-return]
