"""One rank's model: a `LlamaModel` built from the per-rank config (its heads, KV heads and MLP width) that
holds only its slices of every block (shard.py), so the unchanged model code computes the rank's share and the
two all-reduces per layer (`LlamaModel.reduce`) complete it.

Every block this rank holds is also kept as its slice block (`slices`: `<block>@<rank>/<tp>`, slices.py; the model's
CPU tensors are views of it), whichever way it arrived (a checkpoint, a plan's parts after the gather, a plan's
slices), so the rank can send exactly its slices as the source of a matched-TP plan (planload.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kascade_engine.batch.model import LlamaModel
from kascade_engine.tp.shard import TPLayout
from kascade_engine.tp.slices import slice_tensors, whole_id
from kascade_engine.weights.blocks import Block, BlockSet


class RankModel(LlamaModel):
    def __init__(self, cfg: Mapping[str, Any], layout: TPLayout, rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(layout.rank_config(cfg), dtype=dtype, device=device)
        self.full_cfg = dict(cfg)
        self.layout, self.rank = layout, rank
        self.slices: dict[str, Block] = {}  # whole block id -> this rank's slice block

    def add_block(self, block_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """A whole block (every rank's slices) in: this rank keeps its own, packed as its slice block."""
        self.add_sliced(slice_tensors(self.layout, self.rank, block_id, tensors))

    def add_blocks(self, blocks: Iterable[Any]) -> None:
        for b in blocks:
            self.add_block(b.id, b.tensors())

    def add_sliced(self, block: Block) -> None:
        """A slice block (slices.py: already this rank's slices, digest checked by the caller) in, as is."""
        bid = whole_id(block.id)
        LlamaModel.add_block(self, bid, block.tensors())
        self.slices[bid] = block

    def slice_set(self, model: str) -> BlockSet:
        """This rank's slice blocks in model order (what it sends as a matched-TP source)."""
        order = ("embed", *(f"layer.{i}" for i in range(self.shape.layers)), "head")
        return BlockSet(model, self.full_cfg, (self.slices[b] for b in order if b in self.slices and self.resident(b)))
