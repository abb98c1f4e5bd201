"""BlitzScale's sharded load into a tensor-parallel instance: every rank receives 1/g of each block's bytes over
its own link (shard (rank, g) of the block, `net.transfer_spec.shard_range`: the byte ranges a plan's shard flows
already carry), then the ranks all-gather the parts (gloo on CPU stands in for NVLink; NCCL on CUDA), every rank
verifies the whole block's digest, and keeps only its own slices (shard.py). A g-rank target thus ingests g links'
worth of bytes per block, where an unsharded plan feeds the whole block through one.

Data flow per block: my part (bytes [lo, hi) of the block) -> all_gather of equal-length padded parts ->
concatenation trimmed to the block's size -> digest check (a mismatch raises `GatherError` naming the block, and
no rank adds it: every rank computes the same verdict from the same gathered bytes) -> `Block` -> the rank's
`RankModel.add_block` keeps its slices.

Where the parts come from: each rank's own plane of a plan (planes.py `install`, called by rank processes and by
planload.py). When source and target TP match, slices (slices.py) need no gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kascade_engine.net.transfer_spec import shard_range
from kascade_engine.weights.blocks import Block, TensorMeta, digest_matches


class GatherError(RuntimeError):
    """A block whose gathered bytes do not match its digest: nothing of it became resident."""


def my_range(nbytes: int, rank: int, tp: int) -> tuple[int, int]:
    """The bytes of a block of `nbytes` rank `rank` receives over its own link."""
    return shard_range(nbytes, (rank, tp))


def gather_block(block_id: str, entry: Mapping[str, Any], part: bytes | memoryview, rank: int, tp: int,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> Block:
    """All-gather the ranks' parts of one block (manifest `entry`: bytes, digest, index) into the whole block,
    verified. Every rank of `group` calls it for the same block in the same order (a collective)."""
    size = int(entry["bytes"])
    lo, hi = my_range(size, rank, tp)
    if len(part) != hi - lo:
        raise GatherError(f"block {block_id}: rank {rank} holds {len(part)} bytes of its part, expected {hi - lo}")
    width = my_range(size, 0, tp)[1]  # shard 0 is the longest (ceil)
    dev = device or torch.device("cpu")  # NCCL gathers device tensors (over NVLink): UNVERIFIED without a GPU
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    if len(part):
        mine[:len(part)] = torch.frombuffer(bytearray(part), dtype=torch.uint8).to(dev)
    parts = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(tp)]
    dist.all_gather(parts, mine, group=group)
    whole = torch.cat([p[:b - a] for p, (a, b) in zip(parts, (my_range(size, r, tp) for r in range(tp)),
                                                        strict=True)]).cpu()
    data = whole.numpy().data.cast("B")
    if not digest_matches(data, str(entry["digest"])):
        raise GatherError(f"block {block_id}: digest mismatch after the all-gather (a rank's part is corrupt)")
    index = tuple(TensorMeta(str(n), int(o), tuple(int(x) for x in s), str(d)) for n, o, s, d in entry["index"])
    return Block(block_id, data, index, str(entry["digest"]))


def gather_all(manifest: Mapping[str, Mapping[str, Any]], parts: Mapping[str, bytes | memoryview], rank: int,
               tp: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> Sequence[Block]:
    """Every block of `manifest`, in its order, gathered and verified (all before any is used)."""
    return [gather_block(bid, entry, parts[bid], rank, tp, group, device) for bid, entry in manifest.items()]
