"""A request's KV between the ranks of a tensor-parallel instance, for disaggregated serving (pd/): "gathered at
rank 0". Every rank's paged cache holds only its KV heads (shard.py) at the same slots (rank 0's page tables), while
the KV wire (pd/kv_wire.py) carries the whole model's heads, so a TP prefill engine feeds any decode engine and a TP
decode engine takes any prefill engine's KV, whatever either's tp.

Data flow, prefill side (P is TP-g): the step's forward runs on every rank (step.py `Step`) -> rank 0 sends
`GatherKV(slots)` on the control group -> every rank copies its heads of those slots, every layer, to host memory
-> `dist.gather` to rank 0 -> `TPLayout.whole_kv` puts the heads in model order -> the prefill server ships them as
a TP-1 engine does. Decode side (D is TP-g): the whole KV landed on rank 0 -> `ScatterKV(slots)` -> rank 0 cuts every
rank its heads (`TPLayout.kv_of`) -> `dist.scatter` -> every rank writes them into its cache at those slots.
The tensors cross the gloo control group as bytes (any dtype, bfloat16 included); on CUDA they go through host
memory (the control group is gloo there too: UNVERIFIED without a GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kascade_engine.batch.kvcache import KVCache
from kascade_engine.tp.shard import TPLayout


def _local(cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """This rank's K and V of `slots`, every layer: [2, layers, n, local_kv_heads, head_dim], host, contiguous."""
    return torch.stack((cache.k.index_select(1, slots), cache.v.index_select(1, slots))).cpu().contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def gather(layout: TPLayout, cache: KVCache, slots: list[int], group: dist.ProcessGroup | None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 (its `GatherKV` sent): every rank's heads of `slots` -> the whole model's K and V, [layers, n,
    kv_heads, head_dim] each, host memory."""
    mine = _local(cache, torch.tensor(slots, dtype=torch.long, device=cache.device))
    got = [torch.empty_like(mine) for _ in range(layout.tp)]
    dist.gather(_bytes(mine), [_bytes(t) for t in got], dst=0, group=group)
    whole = layout.whole_kv(got)
    return whole[0], whole[1]


def give(cache: KVCache, slots: list[int], group: dist.ProcessGroup | None) -> None:
    """A follower's side of `gather` (on `GatherKV`)."""
    mine = _local(cache, torch.tensor(slots, dtype=torch.long, device=cache.device))
    dist.gather(_bytes(mine), None, dst=0, group=group)


def _write(cache: KVCache, slots: list[int], kv: torch.Tensor) -> None:
    idx = torch.tensor(slots, dtype=torch.long, device=cache.device)
    cache.k.index_copy_(1, idx, kv[0].to(cache.device))
    cache.v.index_copy_(1, idx, kv[1].to(cache.device))


def scatter(layout: TPLayout, cache: KVCache, slots: list[int], k: torch.Tensor, v: torch.Tensor,
            group: dist.ProcessGroup | None) -> None:
    """Rank 0 (its `ScatterKV` sent): the whole model's K and V of `slots` ([layers, n, kv_heads, head_dim], host)
    -> every rank's heads into its cache, this rank's included."""
    both = torch.stack((k, v))
    parts = [layout.kv_of(r, both).contiguous() for r in range(layout.tp)]
    mine = torch.empty_like(parts[0])
    dist.scatter(_bytes(mine), [_bytes(t) for t in parts], src=0, group=group)
    _write(cache, slots, mine)


def take(cache: KVCache, slots: list[int], group: dist.ProcessGroup | None) -> None:
    """A follower's side of `scatter` (on `ScatterKV`): its heads of `slots` into its cache."""
    mine = torch.empty((2, cache.layers, len(slots), cache.kv_heads, cache.head_dim), dtype=cache.dtype)
    dist.scatter(_bytes(mine), None, src=0, group=group)
    _write(cache, slots, mine)
