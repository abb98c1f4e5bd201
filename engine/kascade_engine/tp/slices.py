"""Matched TP (source and target at the same tp): rank r of the source sends rank r of the target exactly its
slices, so nothing is gathered. A slice block is a `Block` of its own — the rank's slices of one block packed
contiguously, with its own tensor index and digest — so the receiving rank verifies it before anything is resident,
as for whole blocks.

Data flow: a whole block -> `slice_block(layout, rank, block)` (on the source: its resident slices are exactly
these) -> bytes + index + digest on the wire -> `Block.verify()` on the receiving rank -> `RankModel.add_sliced`.
Used by rank planes in "slices" mode (planes.py `share_blocks`, planload.py: a TP-g engine's load-plan from a
TP-g source), and by `RankModel`, which keeps every rank's slices as slice blocks (`slice_tensors`), so each rank of
a serving TP instance can send them as the source of the next matched plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kascade_engine.tp.shard import TPLayout
from kascade_engine.weights.blocks import Block, TensorMeta, digest_of

_CODE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}


def slice_block(layout: TPLayout, rank: int, block: Block) -> Block:
    """Rank `rank`'s slices of `block` as a block of their own (id `<block>@<rank>/<tp>`), digest computed here."""
    return slice_tensors(layout, rank, block.id, block.tensors())


def slice_tensors(layout: TPLayout, rank: int, block_id: str, tensors: Mapping[str, torch.Tensor]) -> Block:
    """Rank `rank`'s slices of one whole block's tensors, packed as the slice block `<block>@<rank>/<tp>` (its
    buffer is writable, so the rank's model tensors can be views of it: one copy of the slices, not two)."""
    parts = layout.shard(rank, block_id, tensors)
    index: list[TensorMeta] = []
    chunks: list[bytes] = []
    off = 0
    for name, t in parts.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        index.append(TensorMeta(name, off, tuple(t.shape), _CODE[t.dtype]))
        chunks.append(raw)
        off += len(raw)
    data = memoryview(bytearray(b"".join(chunks)))
    return Block(f"{block_id}@{rank}/{layout.tp}", data, tuple(index), digest_of(data))


def whole_id(slice_id: str) -> str:
    """The block a slice block belongs to ("layer.3@1/2" -> "layer.3")."""
    return slice_id.split("@", 1)[0]
