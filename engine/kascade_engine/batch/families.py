"""Checkpoint families: which Hugging Face architectures the engine runs, and what each one's tensors
are. All are Llama-shaped decoders (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU);
they differ in a few switches:

  LlamaForCausalLM    Llama 2/3 (llama3 or linear rope scaling), SmolLM2; `attention_bias` adds q/k/v/o bias
  MistralForCausalLM  as Llama, plus `sliding_window` (every layer attends to the last W positions only)
  Qwen2ForCausalLM    Qwen2/2.5: q/k/v bias
  Qwen3ForCausalLM    q/k RMSNorm per head (`self_attn.q_norm`, `k_norm`) before rotary
  (Qwen2/3 with `use_sliding_window`: the window applies to the layers `layer_types` marks sliding, or
  to layers >= `max_window_layers`, as transformers does)

Data flow: config.json -> `family_of(cfg)` (an unsupported architecture or setting is refused, naming
it) -> `sliding_windows(cfg)` (per layer: attention window or None) -> `expected_shapes(cfg)` (every tensor name with
its shape; packing checks the checkpoint against
it) and `rope_params(cfg)` (rotary base and scaling, which the model turns into frequencies).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class FamilyError(ValueError):
    """An architecture or config setting the engine cannot run exactly; the message names it."""


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def family_of(cfg: Mapping[str, Any]) -> Family:
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = str(archs[0])
    if arch not in ARCHITECTURES:
        raise FamilyError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    if cfg.get("mlp_bias"):
        raise FamilyError(f"{arch}: config field 'mlp_bias' = true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise FamilyError(f"{arch}: config field 'hidden_act' = {act!r} is not supported (silu only)")
    bias = bool(cfg.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        return Family(arch, qkv_bias=True)
    if arch == "Qwen3ForCausalLM":
        return Family(arch, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return Family(arch, qkv_bias=bias, o_bias=bias)


# Bounds on config.json integers: an absurd value (1e9 layers) must be a clear error, not an attempt to
# allocate; the largest public models stay far below these.
LIMITS = {"num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
          "num_attention_heads": 4096, "num_key_value_heads": 4096, "vocab_size": 1 << 22}


def _int(cfg: Mapping[str, Any], key: str) -> int:
    try:
        v = cfg[key]
    except KeyError:
        raise FamilyError(f"missing field {key!r}") from None
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
        raise FamilyError(f"field {key!r} must be an integer, got {v!r}")
    n = int(v)
    if not 1 <= n <= LIMITS.get(key, 1 << 31):
        raise FamilyError(f"field {key!r} = {n} outside 1..{LIMITS.get(key, 1 << 31)}")
    return n


def head_dim(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads"))


def expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape, in model order."""
    fam = family_of(cfg)
    h, inter, vocab = _int(cfg, "hidden_size"), _int(cfg, "intermediate_size"), _int(cfg, "vocab_size")
    heads = _int(cfg, "num_attention_heads")
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = head_dim(cfg)
    per_layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (kv * hd, h),
        "self_attn.v_proj.weight": (kv * hd, h), "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    if fam.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (heads * hd,), "self_attn.k_proj.bias": (kv * hd,),
                          "self_attn.v_proj.bias": (kv * hd,)})
    if fam.o_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if fam.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(_int(cfg, "num_hidden_layers")):
        out.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, h)
    return out


def rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Rotary settings, from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
    p = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    p = {**scaling, **p}
    p.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind not in ("default", "llama3", "linear"):
        raise FamilyError(f"config field 'rope_scaling': rope type {kind!r} is not supported (default, llama3, linear)")
    p["rope_type"] = kind
    return p


def sliding_windows(cfg: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Per layer, how many most recent positions (the query's own included) a query attends to, or
    None for full causal attention; transformers' rule: key j is visible to query i iff i - W < j <= i."""
    fam, layers = family_of(cfg), _int(cfg, "num_hidden_layers")
    qwen = fam.name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    w = cfg.get("sliding_window")
    if fam.name == "LlamaForCausalLM" or w is None or (qwen and not cfg.get("use_sliding_window")):
        return (None,) * layers
    window = _int(cfg, "sliding_window")
    if not qwen:
        return (window,) * layers  # Mistral: every layer
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers") or 0)
        return tuple(window if i >= first else None for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise FamilyError(f"field 'layer_types' must list one type per layer ({layers}), got {types!r}")
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise FamilyError(f"field 'layer_types': unsupported layer type {bad[0]!r} (sliding_attention, full_attention)")
    return tuple(window if t == "sliding_attention" else None for t in types)
