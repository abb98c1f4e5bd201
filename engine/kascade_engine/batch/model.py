"""The model: a Llama-shaped decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; the
per-family switches of families.py: q/k/v bias, q/k norm, rope scaling, tied head) that runs any
contiguous range of layers for a whole batch of sequences at once.

Data flow: config.json + per-block tensor dicts (HF names, from `Block.tensors()`) ->
`add_block(id, tensors)` puts that block on the model's device/dtype and makes it runnable at once
(live loading) -> `embed(ids)` -> `run_layers(a, b, hidden [N, H], batch)`: every linear layer runs once
on all N tokens of the step; attention writes the new K/V into the paged cache and reads each group's
context through `scaled_dot_product_attention` (kvcache.py builds the groups) -> `logits(hidden)`.
A split run is `run_layers(0, k)` on one engine and `run_layers(k, L)` on another with the same ops.
Every tensor made here names the model's device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
import torch.nn.functional as F

from kascade_engine.batch import attention
from kascade_engine.batch.families import Family, family_of, head_dim, rope_params, sliding_windows
from kascade_engine.batch.kvcache import ForwardBatch, SequenceKV

_P = ParamSpec("_P")
_R = TypeVar("_R")


def inference(f: Callable[_P, _R]) -> Callable[_P, _R]:
    """`torch.inference_mode()` around `f`, entered only when not on already (the engine enters it once per step:
    a context manager per model call costs ~10 Python calls)."""
    @functools.wraps(f)
    def run(*a: _P.args, **k: _P.kwargs) -> _R:
        if torch.is_inference_mode_enabled():
            return f(*a, **k)
        with torch.inference_mode():
            return f(*a, **k)
    return run


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    eps: float
    tie: bool
    max_positions: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> LlamaShape:
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(h, heads, int(cfg.get("num_key_value_heads") or heads), head_dim(cfg),
                       int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]), float(cfg.get("rms_norm_eps", 1e-6)),
                       bool(cfg.get("tie_word_embeddings", False)), int(cfg.get("max_position_embeddings") or 4096))
        except KeyError as e:
            raise ValueError(f"model config lacks field {e.args[0]!r}") from None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    if dt == torch.float32 and w.dtype == dt:  # one fused op; the same formula as below in float32
        return torch.rms_norm(x, (x.shape[-1],), w, eps)  # F.rms_norm without its Python wrapper
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dt)


def _linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    bias = w.get(name + ".bias")
    return F.linear(x, w[name + ".weight"], bias)


def rope_inv_freq(cfg: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """Rotary inverse frequencies in float32, computed as transformers does (scaling applied)."""
    p, d = rope_params(cfg), head_dim(cfg)
    inv = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if p["rope_type"] == "linear":
        return inv / float(p["factor"])
    if p["rope_type"] == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        wave = 2 * torch.pi / inv
        scaled = torch.where(wave > old / lo, inv / factor, inv)  # low frequencies: divided by factor
        smooth = (old / wave - lo) / (hi - lo)
        mixed = (1 - smooth) * scaled / factor + smooth * scaled  # in between: interpolated
        medium = ~(wave < old / hi) & ~(wave > old / lo)
        return torch.where(medium, mixed, scaled)
    return inv


class LlamaModel:
    """Weights held per block; layers run only when their block is resident."""

    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.cfg = dict(cfg)
        self.shape = LlamaShape.from_config(cfg)
        self.family: Family = family_of(cfg)
        self.windows = sliding_windows(cfg)  # per layer: sliding attention window (Mistral) or None
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights: dict[str, dict[str, torch.Tensor]] = {}
        self.version = 0  # counts `add_block` calls: CUDA graphs captured at an older version are stale (graphs.py)
        self._staging: torch.Tensor | None = None  # pinned host buffer for CUDA uploads
        self._upload: torch.cuda.Stream | None = None  # CUDA: the side stream blocks are uploaded on
        self.inv_freq = rope_inv_freq(cfg, self.device)
        self._rope_table: torch.Tensor | None = None  # [positions, 2, 1, head_dim]: cos, signed sin (`_rope_rows`)
        # tensor parallel (tp/): sums a row-parallel projection's partial output over the ranks, in place
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- residency -------------------------------------------------------------------------
    def add_block(self, block_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
        prefix = {"embed": "model.embed_tokens.", "head": ""}.get(block_id)
        if prefix is None:
            prefix = f"model.layers.{int(block_id.split('.')[1])}."
        names = {k: k[len(prefix):] if k.startswith(prefix) else k for k in tensors}
        self.version += 1
        if self.device.type == "cuda":
            self.weights[block_id] = self._to_cuda({names[k]: v for k, v in tensors.items()})
        else:  # same device and dtype: a zero-copy view of the block's buffer
            self.weights[block_id] = {names[k]: v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}

    def _to_cuda(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host block -> one pinned staging buffer (reused, grown to the largest block) -> device, copied
        asynchronously on a side stream (`_upload`: the decode steps on the default stream do not wait behind
        it) and synchronized once per block on that stream only; the default stream waits for it before the
        block's first use. The host block can be dropped afterwards.
        UNVERIFIED on a GPU (no GPU in development): written so every tensor names its device."""
        total = sum(-(-v.numel() * v.element_size() // 64) * 64 for v in tensors.values())  # 64-byte aligned
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=True)
        if self._upload is None:
            self._upload = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        out: dict[str, torch.Tensor] = {}
        off = 0
        with torch.cuda.stream(self._upload):
            for name, v in tensors.items():
                n = v.numel() * v.element_size()
                host = self._staging[off:off + n]
                host.copy_(v.contiguous().view(-1).view(torch.uint8))
                dev = host.to(device=self.device, non_blocking=True).view(v.dtype).view(v.shape)
                out[name] = dev.to(self.dtype)
                off += -(-n // 64) * 64
        self._upload.synchronize()  # the staging buffer is reused by the next block
        for t in out.values():  # allocated on the side stream, used on the default one from now on
            t.record_stream(torch.cuda.current_stream(self.device))
        return out

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
    @inference
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.embedding(self._need("embed")["weight"], ids if ids.device == self.device else ids.to(self.device))

    @inference
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._need("head")
        x = _rms(hidden, head["model.norm.weight"], self.shape.eps)
        w = head.get("lm_head.weight")
        if w is None:
            w = self._need("embed")["weight"]
        out = F.linear(x, w)
        return out if out.dtype == torch.float32 else out.float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin [N, 1, head_dim] of the step, once per step: x * cos + roll(x) * sin is
        transformers' x * cos + rotate_half(x) * sin exactly (rotate_half(x) = roll(x, d/2) with the first half
        negated; the sign sits in sin), in two ops fewer per tensor."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :freqs.shape[1]].neg_()
        return emb.cos().to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def _rope_rows(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rope(positions)` read from a table of every position up to `top` (made by `_rope` itself, grown to a
        power of two when a step reaches past it): one index_select a step instead of ~13 ops."""
        t = self._rope_table
        if t is None or t.shape[0] <= top:
            cos, sin = self._rope(torch.arange(max(256, 1 << top.bit_length()), dtype=torch.long, device=self.device))
            t = self._rope_table = torch.stack((cos, sin), 1)
        rows = t.index_select(0, positions)
        return rows[:, 0], rows[:, 1]

    @inference
    def run_layers(self, a: int, b: int, hidden: torch.Tensor, kv: ForwardBatch | SequenceKV,
                   start: int = 0) -> torch.Tensor:
        """Layers a..b-1 on `hidden` [N, H]: a step's `ForwardBatch`, or one sequence's `SequenceKV`
        whose new tokens start at position `start` (live split)."""
        if not 0 <= a <= b <= self.shape.layers:
            raise ValueError(f"layer range {a}..{b} outside 0..{self.shape.layers}")
        if isinstance(kv, SequenceKV):
            s = self.shape
            batch = kv.batch((s.layers, s.kv_heads, s.head_dim), self.dtype, self.device, a, b, start,
                             hidden.shape[0])
            out = self._layers(a, b, hidden, batch)
            kv.commit(a, b, start + hidden.shape[0])
            return out
        return self._layers(a, b, hidden, kv)

    def _layers(self, a: int, b: int, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s, fam = self.shape, self.family
        N = x.shape[0]
        if batch.rope is None:
            top = batch.max_position
            batch.rope = self._rope(batch.positions) if top is None else self._rope_rows(batch.positions, top)
            if batch.decode is not None and attention.backend(self.device) == "flashinfer":
                attention.plan_flashinfer(batch.decode, s.heads, s.kv_heads, s.head_dim, self.dtype, self.windows)
        cos, sin = batch.rope
        for i in range(a, b):
            w = self._need(f"layer.{i}")
            h = _rms(x, w["input_layernorm.weight"], s.eps)
            q = _linear(h, w, "self_attn.q_proj").view(N, s.heads, s.head_dim)
            k = _linear(h, w, "self_attn.k_proj").view(N, s.kv_heads, s.head_dim)
            v = _linear(h, w, "self_attn.v_proj").view(N, s.kv_heads, s.head_dim)
            if fam.qk_norm:
                q = _rms(q, w["self_attn.q_norm.weight"], s.eps)
                k = _rms(k, w["self_attn.k_norm.weight"], s.eps)
            half = s.head_dim // 2
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            batch.cache.write(i, batch.slots, k, v)
            attn = self._attend(i, q, k, v, batch)
            o = _linear(attn, w, "self_attn.o_proj")
            x = x + (o if self.reduce is None else self.reduce(o))
            h = _rms(x, w["post_attention_layernorm.weight"], s.eps)
            m = F.linear(F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"]),
                         w["mlp.down_proj.weight"])
            x = x + (m if self.reduce is None else self.reduce(m))
        return x

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q [N, heads, D] (k, v: this layer's new K/V, already in the cache) -> [N, heads * D] (attention.py)."""
        s, window = self.shape, self.windows[layer]
        if batch.fresh and window is None:
            return attention.fresh(q, k, v)
        N, width = q.shape[0], s.heads * s.head_dim
        d = batch.decode
        if d is not None and d.first == 0 and d.rows is None and d.batch == N:
            return attention.decode(q, batch, d, layer, window)  # all decodes
        out = torch.empty(N, width, dtype=q.dtype, device=q.device)
        if d is not None:
            o = attention.decode(q[d.first:d.first + d.batch] if d.rows is None else q.index_select(0, d.rows),
                                 batch, d, layer, window)
            if d.rows is None:
                out[d.first:d.first + d.batch] = o
            else:
                out.index_copy_(0, d.rows, o)
        flat = q.reshape(N, width)
        for g in batch.groups:
            o = attention.padded(flat, batch, g, layer, window, s.heads)
            r0, r1 = g.rows
            if g.src is None and r1 - r0 == N:
                return o  # one group covers the whole step (one prefill chunk)
            if g.src is None:
                out[r0:r1] = o
            else:
                assert g.keep is not None and g.dest is not None
                out.index_copy_(0, g.dest, o.index_select(0, g.keep))
        return out
