"""Megatron-style tensor-parallel split of a Llama-shaped checkpoint: which slice of every tensor rank r of a
`tp`-rank instance holds, and the per-rank model config its `LlamaModel` is built from.

Split (Megatron-LM, Shoeybi et al. 2019):
  q/k/v_proj   column-parallel: rank r holds heads r*H/tp .. (r+1)*H/tp - 1 (rows of the weight, and of the bias)
               and the KV heads those query heads read. When tp > KV heads (tp a multiple of them), each KV head
               is replicated on the tp/KV ranks whose query heads share it (as vLLM does).
  o_proj       row-parallel: rank r holds the input columns of its heads; its bias only on rank 0 (added once)
  gate/up      column-parallel: rank r holds 1/tp of the intermediate rows
  down_proj    row-parallel: the matching 1/tp of the input columns
  q/k norm, layer norms, final norm: replicated (a few KiB)
  embedding    replicated: every rank needs the whole hidden state of every token as input, and a vocabulary-split
               embedding costs one more all-reduce per step for a table that is ~1/(2*layers) of the weights
  LM head      rank 0 only: only rank 0 samples, so no rank needs logits but rank 0 and no all-gather of
               logits is needed; the cost is vocab x hidden more bytes on rank 0 (2.1 GB for Llama-3-70B in
               bf16, against ~17.5 GB of layer weights per rank at tp 8)
One all-reduce (sum) follows o_proj and one follows down_proj in every layer (model.py `LlamaModel.reduce`).

Data flow: config.json -> `TPLayout.of(cfg, tp)` (refuses a tp that does not divide, naming the field) ->
`layout.rank_config(cfg)` (the per-rank config: local heads, KV heads, intermediate size; head_dim explicit) ->
`layout.shard(rank, block_id, tensors)` (views of the full tensors, contiguous copies) -> `LlamaModel.add_block`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kascade_engine.batch.families import FamilyError, head_dim


class TPError(ValueError):
    """A tensor-parallel degree the model cannot be split by; the message names the field."""


@dataclass(frozen=True)
class TPLayout:
    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, cfg: Mapping[str, Any], tp: int) -> TPLayout:
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64:
            raise TPError(f"tp: {tp!r} must be an integer in 1..64")
        try:
            heads = int(cfg["num_attention_heads"])
            kv = int(cfg.get("num_key_value_heads") or heads)
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise FamilyError(f"missing field {e.args[0]!r}") from None
        if heads % tp:
            raise TPError(f"tp: {tp} does not divide num_attention_heads ({heads})")
        if kv % tp and tp % kv:
            raise TPError(f"tp: {tp} does not divide num_key_value_heads ({kv}) nor is a multiple of it")
        if inter % tp:
            raise TPError(f"tp: {tp} does not divide intermediate_size ({inter})")
        return cls(tp, heads, kv, head_dim(cfg), inter)

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.tp)

    def kv_first(self, rank: int) -> int:
        """The first KV head rank `rank` holds."""
        if self.kv_heads >= self.tp:
            return rank * self.local_kv_heads
        return rank // (self.tp // self.kv_heads)  # replicated: the KV head of this rank's query heads

    def rank_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The config a rank's LlamaModel is built from (its own heads, KV heads and MLP width)."""
        out = dict(cfg)
        out.update(num_attention_heads=self.local_heads, num_key_value_heads=self.local_kv_heads,
                   intermediate_size=self.intermediate // self.tp, head_dim=self.head_dim)
        return out

    def kv_of(self, rank: int, kv: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s KV heads of a whole-model KV tensor (heads on dim -2: [..., kv_heads, head_dim]), a view."""
        first = self.kv_first(rank)
        return kv[..., first:first + self.local_kv_heads, :]

    def whole_kv(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's KV heads ([..., local_kv_heads, head_dim], rank order) -> the whole model's
        [..., kv_heads, head_dim]; a KV head replicated on several ranks (tp > KV heads) is taken once."""
        if len(per_rank) != self.tp:
            raise TPError(f"tp: {len(per_rank)} ranks' KV for tp {self.tp}")
        *lead, _, d = per_rank[0].shape
        out = per_rank[0].new_empty((*lead, self.kv_heads, d))
        for r, t in enumerate(per_rank):
            if r == 0 or self.kv_first(r) != self.kv_first(r - 1):
                self.kv_of(r, out).copy_(t)
        return out

    def shard(self, rank: int, block_id: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank `rank`'s slices of one block's tensors (HF names), each a contiguous tensor."""
        if not 0 <= rank < self.tp:
            raise TPError(f"rank: {rank} outside 0..{self.tp - 1}")
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            s = self.slice_of(rank, name, t)
            if s is not None:
                out[name] = s.contiguous()
        return out

    def slice_of(self, rank: int, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """One tensor's slice on `rank` (a view), the whole tensor when replicated, None when not held."""
        if self.tp == 1:
            return t
        d = self.head_dim
        if name == "lm_head.weight":
            return t if rank == 0 else None
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            n = self.local_heads * d
            return t[rank * n:(rank + 1) * n]
        if any(name.endswith(f"self_attn.{p}_proj.{k}") for p in "kv" for k in ("weight", "bias")):
            n = self.local_kv_heads * d
            first = self.kv_first(rank) * d
            return t[first:first + n]
        if name.endswith("self_attn.o_proj.weight"):
            n = self.local_heads * d
            return t[:, rank * n:(rank + 1) * n]
        if name.endswith("self_attn.o_proj.bias"):
            return t if rank == 0 else None
        if name.endswith("mlp.gate_proj.weight") or name.endswith("mlp.up_proj.weight"):
            n = self.intermediate // self.tp
            return t[rank * n:(rank + 1) * n]
        if name.endswith("mlp.down_proj.weight"):
            n = self.intermediate // self.tp
            return t[:, rank * n:(rank + 1) * n]
        return t  # norms, embedding: replicated
