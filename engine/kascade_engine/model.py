"""The model: a Llama-architecture transformer (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU) that runs any contiguous range of layers on given hidden states.

Data flow: config.json dict + per-block tensor dicts (HF Llama names, from `Block.tensors()`) ->
`LlamaModel.add_block(id, tensors)` makes that block runnable at once (live loading) ->
`embed(ids)` -> `run_layers(a, b, hidden, kv, pos)` (layers a..b-1, KV cache updated in place) ->
`logits(hidden)`. A split run is `run_layers(0, k)` on one engine and `run_layers(k, L)` on another;
because every op is the same, the result is bit-identical to a single run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kascade_engine.kvcache import SequenceKV


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    eps: float
    rope_theta: float
    tie: bool

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> LlamaShape:
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
            return cls(h, heads, int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or h // heads),
                       int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]), float(cfg.get("rms_norm_eps", 1e-6)),
                       float(theta), bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ValueError(f"model config lacks field {e.args[0]!r}") from None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaModel:
    """Weights held per block; layers run only when their block is resident."""

    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.cfg = dict(cfg)
        self.shape = LlamaShape.from_config(cfg)
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        s = self.shape
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64, device=self.device).float() / s.head_dim))

    # -- residency -------------------------------------------------------------------------
    def add_block(self, block_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
        prefix = {"embed": "model.embed_tokens.", "head": ""}.get(block_id)
        if prefix is None:
            prefix = f"model.layers.{int(block_id.split('.')[1])}."
        self.weights[block_id] = {k[len(prefix):] if k.startswith(prefix) else k: v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}

    def resident(self, block_id: str) -> bool:
        return block_id in self.weights

    def resident_prefix(self) -> int:
        """Number of leading layers that are runnable now."""
        n = 0
        while n < self.shape.layers and f"layer.{n}" in self.weights:
            n += 1
        return n

    @property
    def complete(self) -> bool:
        return "embed" in self.weights and "head" in self.weights and self.resident_prefix() == self.shape.layers

    def _need(self, block_id: str) -> dict[str, torch.Tensor]:
        w = self.weights.get(block_id)
        if w is None:
            raise RuntimeError(f"block {block_id} is not resident")
        return w

    # -- compute ---------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._need("embed")["weight"][ids]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._need("head")
        x = _rms(hidden, head["model.norm.weight"], self.shape.eps)
        w = head.get("lm_head.weight")
        if w is None:
            w = self._need("embed")["weight"]
        return (x @ w.T).float()

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def run_layers(self, a: int, b: int, hidden: torch.Tensor, kv: SequenceKV, start: int) -> torch.Tensor:
        """Layers a..b-1 on `hidden` [T, H] of one sequence whose first token is at position `start`."""
        if not 0 <= a <= b <= self.shape.layers:
            raise ValueError(f"layer range {a}..{b} outside 0..{self.shape.layers}")
        s = self.shape
        T = hidden.shape[0]
        cos, sin = self._rope(torch.arange(start, start + T, device=self.device))
        x = hidden
        for i in range(a, b):
            w = self._need(f"layer.{i}")
            h = _rms(x, w["input_layernorm.weight"], s.eps)
            q = (h @ w["self_attn.q_proj.weight"].T).view(T, s.heads, s.head_dim).transpose(0, 1)
            k = (h @ w["self_attn.k_proj.weight"].T).view(T, s.kv_heads, s.head_dim).transpose(0, 1)
            v = (h @ w["self_attn.v_proj.weight"].T).view(T, s.kv_heads, s.head_dim).transpose(0, 1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = kv.append(i, start, k, v)
            rep = s.heads // s.kv_heads
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
            total = k.shape[1]
            scores = (q @ k.transpose(1, 2)) / math.sqrt(s.head_dim)
            # causal mask: query t (absolute start+t) sees keys 0..start+t
            mask = torch.arange(total, device=self.device)[None, :] > (torch.arange(T, device=self.device)[:, None] + start)
            scores = scores.masked_fill(mask, float("-inf"))
            attn = torch.softmax(scores.float(), dim=-1).to(self.dtype) @ v
            x = x + attn.transpose(0, 1).reshape(T, s.heads * s.head_dim) @ w["self_attn.o_proj.weight"].T
            h = _rms(x, w["post_attention_layernorm.weight"], s.eps)
            gate = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        return x
