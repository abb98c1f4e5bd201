"""Blocks: a Llama checkpoint packed as one contiguous buffer per transformer layer, plus `embed` and
`head`. Blocks are the unit of transfer, residency and live execution.

Data flow: safetensors files (HF Llama names) + config.json -> `pack_checkpoint` checks every tensor
(missing, duplicated, unexpected or mis-shaped ones are refused, naming the tensor) -> `Block`s with
an index (tensor name -> offset, shape, dtype) and an xxh3-128 digest -> `Block.tensors()` gives torch
views into the buffer without copying.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

ALIGN = 64
LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "I64": np.int64, "I32": np.int32}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be packed; the message names the tensor or file."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: F32, F16, BF16, ...

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Block:
    id: str
    data: memoryview  # contiguous bytes
    index: tuple[TensorMeta, ...]
    digest: str

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def tensors(self) -> dict[str, Any]:
        """torch tensors viewing this block's buffer (no copy)."""
        import torch

        tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}
        buf = self.data if not self.data.readonly else memoryview(bytearray(self.data))
        flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        return {m.name: flat[m.offset:m.offset + m.nbytes].view(tdt[m.dtype]).view(m.shape) for m in self.index}

    def verify(self) -> bool:
        return digest_matches(self.data, self.digest)


# Block digests verify transfers, so they must run at line rate: xxh3-128 hashes ~10 GB/s on one core
# here, sha256 ~1 GB/s (it capped a verified hop at a third of raw loopback TCP, and would cap a
# 100-400 Gbit/s NIC far lower). Who may send is settled by the plan token on every connection; the
# digest catches corruption. A digest names its algorithm ("xxh3-128:<hex>"); a bare 64-hex digest is
# sha256 (host caches written before the switch still verify).
DIGEST_ALGO = "xxh3-128"


def digest_of(data: memoryview | bytes | bytearray, algo: str = DIGEST_ALGO) -> str:
    if algo == "xxh3-128":
        return "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown digest algorithm {algo!r} (xxh3-128 or sha256)")


def digest_matches(data: memoryview | bytes | bytearray, digest: str) -> bool:
    """Whether `data` has `digest`, in the algorithm the digest names (an unknown one never matches)."""
    algo = digest.split(":", 1)[0] if ":" in digest else "sha256"
    try:
        return hmac.compare_digest(digest_of(data, algo), digest)
    except ValueError:
        return False


def block_ids(layers: int) -> tuple[str, ...]:
    return ("embed", *(f"layer.{i}" for i in range(layers)), "head")


def block_of(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "embed"
    if name in ("model.norm.weight", "lm_head.weight"):
        return "head"
    m = _LAYER.match(name)
    return f"layer.{m.group(1)}" if m else None


def expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, with its shape, from config.json."""
    h, inter, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads", heads))
    hd = int(cfg.get("head_dim") or h // heads)
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (kv * hd, h),
                 "self_attn.v_proj.weight": (kv * hd, h), "self_attn.o_proj.weight": (h, heads * hd),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, h)
    for i in range(int(cfg["num_hidden_layers"])):
        out.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return out


def _read_safetensors(path: Path) -> Iterable[tuple[str, str, tuple[int, ...], memoryview]]:
    raw = path.read_bytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: not a safetensors file ({e})") from None
    base = 8 + n
    view = memoryview(raw)
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in ITEMSIZE:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        yield name, meta["dtype"], tuple(meta["shape"]), view[base + begin:base + end]


class BlockSet:
    """All blocks of one model, by id, in model order."""

    def __init__(self, model: str, config: Mapping[str, Any], blocks: Iterable[Block]) -> None:
        self.model = model
        self.config = dict(config)
        self.blocks: dict[str, Block] = {b.id: b for b in blocks}

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self.blocks)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def manifest(self) -> dict[str, dict[str, Any]]:
        """What a receiver needs to allocate and verify: size, digest and index per block."""
        return {b.id: {"bytes": b.nbytes, "digest": b.digest,
                       "index": [[m.name, m.offset, list(m.shape), m.dtype] for m in b.index]}
                for b in self.blocks.values()}


def index_from_manifest(entry: Mapping[str, Any]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(str(n), int(o), tuple(int(x) for x in s), str(d)) for n, o, s, d in entry["index"])


def pack_checkpoint(directory: Path | str, model: str | None = None) -> BlockSet:
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json")
    cfg = json.loads(cfg_path.read_text())
    try:
        want = expected_shapes(cfg)
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: missing field {e.args[0]!r}") from None
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    found: dict[str, tuple[str, tuple[int, ...], memoryview]] = {}
    for f in files:
        for name, dtype, shape, data in _read_safetensors(f):
            if name in found:
                raise CheckpointError(f"tensor {name!r} is duplicated ({f.name})")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some exporters include
            if name not in want:
                raise CheckpointError(f"unexpected tensor {name!r} in {f.name}")
            if shape != want[name]:
                raise CheckpointError(f"tensor {name!r} has shape {list(shape)}, expected {list(want[name])}")
            found[name] = (dtype, shape, data)
    missing = [n for n in want if n not in found]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    groups: dict[str, list[str]] = {b: [] for b in block_ids(int(cfg["num_hidden_layers"]))}
    for name in want:
        groups[block_of(name) or "head"].append(name)
    blocks = []
    for bid, names in groups.items():
        metas, offset = [], 0
        for name in names:
            dtype, shape, _ = found[name]
            offset = (offset + ALIGN - 1) // ALIGN * ALIGN
            metas.append(TensorMeta(name, offset, shape, dtype))
            offset += metas[-1].nbytes
        buf = bytearray(offset)
        for m in metas:
            buf[m.offset:m.offset + m.nbytes] = found[m.name][2]
        view = memoryview(buf)
        blocks.append(Block(bid, view, tuple(metas), digest_of(view)))
    return BlockSet(model or str(cfg.get("_name_or_path") or d.name), cfg, blocks)
