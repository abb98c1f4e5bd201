"""One rank's model: a `LlamaModel` built from the per-rank config (its heads, KV heads and MLP width) that
holds only its slices of every block (shard.py), so the unchanged model code computes the rank's share and the
two all-reduces per layer (`LlamaModel.reduce`) complete it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kascade_engine.batch.model import LlamaModel
from kascade_engine.tp.shard import TPLayout


class RankModel(LlamaModel):
    def __init__(self, cfg: Mapping[str, Any], layout: TPLayout, rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(layout.rank_config(cfg), dtype=dtype, device=device)
        self.full_cfg = dict(cfg)
        self.layout, self.rank = layout, rank

    def add_block(self, block_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """A whole block (every rank's slices) in: this rank keeps its own."""
        super().add_block(block_id, self.layout.shard(self.rank, block_id, tensors))

    def add_blocks(self, blocks: Iterable[Any]) -> None:
        for b in blocks:
            self.add_block(b.id, b.tensors())

    def add_sliced(self, block: Any) -> None:
        """A slice block (slices.py: already this rank's slices, digest checked by the caller) in, as is."""
        LlamaModel.add_block(self, block.id.split("@", 1)[0], block.tensors())
