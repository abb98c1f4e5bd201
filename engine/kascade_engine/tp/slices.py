"""Matched TP (source and target at the same tp): rank r of the source sends rank r of the target exactly its
slices, so nothing is gathered. A slice block is a `Block` of its own — the rank's slices of one block packed
contiguously, with its own tensor index and digest — so the receiving rank verifies it before anything is resident,
as for whole blocks.

Data flow: a whole block -> `slice_block(layout, rank, block)` (on the source: its resident slices are exactly
these) -> bytes + index + digest on the wire -> `Block.verify()` on the receiving rank -> `RankModel.add_sliced`.
Used by rank planes in "slices" mode (planes.py `share_blocks`; run by `tp.run --plane-dir`); the engine's
load-plan (planload.py) still sends parts and gathers for matched TP too (docs/tp.md).
"""

from __future__ import annotations

import torch

from kascade_engine.tp.shard import TPLayout
from kascade_engine.weights.blocks import Block, TensorMeta, digest_of

_CODE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}


def slice_block(layout: TPLayout, rank: int, block: Block) -> Block:
    """Rank `rank`'s slices of `block` as a block of their own (id `<block>@<rank>/<tp>`), digest computed here."""
    parts = layout.shard(rank, block.id, block.tensors())
    index: list[TensorMeta] = []
    chunks: list[bytes] = []
    off = 0
    for name, t in parts.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        index.append(TensorMeta(name, off, tuple(t.shape), _CODE[t.dtype]))
        chunks.append(raw)
        off += len(raw)
    data = memoryview(b"".join(chunks))
    return Block(f"{block.id}@{rank}/{layout.tp}", data, tuple(index), digest_of(data))


def whole_id(slice_id: str) -> str:
    """The block a slice block belongs to ("layer.3@1/2" -> "layer.3")."""
    return slice_id.split("@", 1)[0]
