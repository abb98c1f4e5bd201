"""Blocks: a checkpoint (any family of families.py) packed as one contiguous buffer per transformer
layer, plus `embed` and `head`. Blocks are the unit of transfer, residency and live execution.

Data flow: a Hugging Face directory (config.json + one or more *.safetensors, sharded with
model.safetensors.index.json or not) -> `pack_checkpoint` validates every header against its file
(tensorfile.py) and every tensor against the family's names and shapes (missing, duplicated,
unexpected or mis-shaped ones are refused, naming the tensor), then copies tensors from memory maps
block by block -> `Block`s with
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
from typing import Any, Protocol

import numpy as np
import xxhash

from kascade_engine.batch.families import FamilyError, expected_shapes
from kascade_engine.weights.tensorfile import TensorEntry, TensorFile, TensorFileError, read_header

ALIGN = 64
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

        tdt = {
            "F32": torch.float32,
            "F16": torch.float16,
            "BF16": torch.bfloat16,
            "I64": torch.int64,
            "I32": torch.int32,
        }
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


class Hasher(Protocol):
    """A streaming hasher (xxhash's and hashlib's objects): `update` in order, then `hexdigest`."""

    def update(self, data: memoryview | bytes | bytearray, /) -> None: ...

    def hexdigest(self) -> str: ...


def digest_string(algo: str, hexdigest: str) -> str:
    """A digest as blocks and manifests carry it: algorithm-prefixed, except bare sha256."""
    return hexdigest if algo == "sha256" else f"{algo}:{hexdigest}"


def split_digest(digest: str) -> tuple[str, str]:
    """(algorithm, hex) of a digest string; a bare one is sha256."""
    algo, sep, hexdigest = digest.partition(":")
    return (algo, hexdigest) if sep else ("sha256", digest)


def new_hasher(algo: str) -> Hasher | None:
    """A streaming hasher whose result equals `digest_of` over the same bytes; None for an unknown algo."""
    if algo == "xxh3-128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    return None


def digest_of(data: memoryview | bytes | bytearray, algo: str = DIGEST_ALGO) -> str:
    if algo == "xxh3-128":
        return digest_string(algo, xxhash.xxh3_128_hexdigest(data))
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown digest algorithm {algo!r} (xxh3-128 or sha256)")


def digest_matches(data: memoryview | bytes | bytearray, digest: str) -> bool:
    """Whether `data` has `digest`, in the algorithm the digest names (an unknown one never matches)."""
    algo = split_digest(digest)[0]
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


WEIGHT_DTYPES = ("F32", "F16", "BF16")
INDEX = "model.safetensors.index.json"


def _entries(d: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint (single file, several files, or sharded with an index), headers
    validated against their files."""
    weight_map: dict[str, str] | None = None
    if (d / INDEX).is_file():
        try:
            doc = json.loads((d / INDEX).read_text())
            weight_map = {str(k): str(v) for k, v in dict(doc["weight_map"]).items()}
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{INDEX}: malformed ({type(err).__name__}: {err})") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (d / f).is_file():
                first = next(n for n, v in weight_map.items() if v == f)
                raise CheckpointError(f"{INDEX}: shard {f} is missing (it holds tensor {first!r})")
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    found: dict[str, TensorEntry] = {}
    for f in files:
        try:
            header = read_header(d / f)
        except TensorFileError as err:
            raise CheckpointError(str(err)) from None
        for name, e in header.items():
            if name in found:
                raise CheckpointError(f"tensor {name!r} is duplicated ({found[name].file.name} and {f})")
            if weight_map is not None and weight_map.get(name) != f:
                raise CheckpointError(f"tensor {name!r} is in {f}, {INDEX} places it in {weight_map.get(name)}")
            found[name] = e
    for name, f in (weight_map or {}).items():
        if name not in found:
            raise CheckpointError(f"missing tensor {name!r} ({INDEX} places it in {f})")
    return found


def tensor_dtypes(directory: Path | str) -> dict[str, str]:
    """Each tensor's dtype code in the checkpoint at `directory`, from its headers alone (no tensor is read)."""
    return {name: e.dtype for name, e in _entries(Path(directory)).items()}


def pack_checkpoint(directory: Path | str, model: str | None = None) -> BlockSet:
    """A Hugging Face checkpoint directory -> blocks. Every header is checked (offsets vs shape x dtype
    vs file size), every tensor against the family's expected names and shapes, before any byte is
    copied or hashed; tensors are then copied block by block from memory maps (peak extra memory: the
    block being packed), so a checkpoint larger than RAM's free share still packs."""
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{cfg_path}: not JSON ({err})") from None
    try:
        want = expected_shapes(cfg)
    except (FamilyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{cfg_path}: {err}") from None
    tied = bool(cfg.get("tie_word_embeddings", False))
    found: dict[str, TensorEntry] = {}
    for name, e in _entries(d).items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # derived buffers some exporters include; a tied head is the embedding
        if name not in want:
            raise CheckpointError(f"unexpected tensor {name!r} in {e.file.name}")
        if e.shape != want[name]:
            raise CheckpointError(f"tensor {name!r} has shape {list(e.shape)}, expected {list(want[name])}")
        if e.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {e.dtype}, expected one of {', '.join(WEIGHT_DTYPES)}")
        found[name] = e
    missing = [n for n in want if n not in found]
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    groups: dict[str, list[str]] = {b: [] for b in block_ids(int(cfg["num_hidden_layers"]))}
    for name in want:
        groups[block_of(name) or "head"].append(name)
    maps: dict[Path, TensorFile] = {}
    blocks = []
    try:
        for bid, names in groups.items():
            metas, offset = [], 0
            for name in names:
                offset = (offset + ALIGN - 1) // ALIGN * ALIGN
                metas.append(TensorMeta(name, offset, found[name].shape, found[name].dtype))
                offset += metas[-1].nbytes
            buf = bytearray(offset)
            for m in metas:
                e = found[m.name]
                tf = maps.get(e.file) or maps.setdefault(e.file, TensorFile(e.file))
                buf[m.offset:m.offset + m.nbytes] = tf.view(e)
            view = memoryview(buf)
            blocks.append(Block(bid, view, tuple(metas), digest_of(view)))
    finally:
        for tf in maps.values():
            tf.close()
    return BlockSet(model or str(cfg.get("_name_or_path") or d.name), cfg, blocks)
