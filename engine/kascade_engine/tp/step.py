"""The step message rank 0 sends every other rank of a tensor-parallel instance, once per forward (`Layers` once
per layer segment of a live pair's staggered forward).

Rank 0 owns the scheduler, the page tables and sampling; a follower rank owns only its slice of the weights and
of the paged KV cache (same page geometry, so the same slot ids). To run the step's forward with rank 0 it needs
exactly what `kvcache.build_batch` and `LlamaModel.embed` take: the step's token ids and, per sequence chunk,
(block table, start position, token count). Both ends use these types; the wire is `broadcast_object_list` on
the instance's gloo control group (pickle between processes of one pod that joined with one rendezvous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Step:
    ids: list[int]  # the step's tokens, flat, in row order
    items: list[tuple[list[int], int, int]]  # per chunk: (block table, start position, new tokens)


@dataclass(frozen=True)
class Stop:
    reason: str  # the instance is shutting down: followers exit 0


@dataclass(frozen=True)
class Load:
    planes: list[dict[str, Any]]  # rank r receives planes[r] (planes.PlaneSpec documents) in the background and
    # goes on following; rank 0 then polls (`Progress`) and installs (`Install`) block by block (progressive.py)


@dataclass(frozen=True)
class Progress:
    """A load in progress: every rank answers its plane's report (progressive.py; a collective: all_gather_object)."""


@dataclass(frozen=True)
class Install:
    blocks: list[str]  # every rank installs these whole blocks from its verified shares, in this order (parts: the
    # all-gather per block, a collective)


@dataclass(frozen=True)
class Abort:
    reason: str  # the load failed on some rank (or was given up): every rank stops receiving its plane
    load: int  # of the load-th Load message (a follower that got a later Load since ignores it)


@dataclass(frozen=True)
class LoadPath:
    path: str  # the first copy: every rank packs this checkpoint directory and keeps its slices


@dataclass(frozen=True)
class Serve:
    planes: list[dict[str, Any]]  # matched TP, this instance a source: rank r sends its slices in plane planes[r]
    # (a TransferSpec document) from its own data port, in the background, and goes on following steps


@dataclass(frozen=True)
class Manifests:
    model: str  # every rank answers its slice blocks' manifest (a collective: all_gather_object)


@dataclass(frozen=True)
class GatherKV:
    slots: list[int]  # every rank sends rank 0 its KV heads of these cache slots, every layer (kv.py; a gather)


@dataclass(frozen=True)
class ScatterKV:
    slots: list[int]  # rank 0 sends every rank its KV heads for these cache slots, every layer (kv.py; a scatter)


@dataclass(frozen=True)
class Layers:
    """A live pair's partial forward (live/cooperation.py `staggered`): layers first..last-1 over `hidden`, the rows'
    hidden states as rank 0 holds them (whole: after an all-reduce, or embedded, or a peer's activations), whose
    chunks are `items` (block table, start, tokens; a pair's private pages are rank 0's page tables too)."""

    first: int
    last: int
    items: list[tuple[list[int], int, int]]
    hidden: torch.Tensor  # [N, H], host memory


Message = (Step | Stop | Load | Progress | Install | Abort | LoadPath | Serve | Manifests | GatherKV | ScatterKV
           | Layers)


def send(msg: Message, group: dist.ProcessGroup | None) -> None:
    """Rank 0: broadcast `msg` to every rank of `group`."""
    dist.broadcast_object_list([msg], src=0, group=group)


def receive(group: dist.ProcessGroup | None) -> Message:
    """A follower: block until rank 0's next message."""
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    msg = box[0]
    if not isinstance(msg, Message):
        raise RuntimeError(f"tp step channel: expected a step message ({Message}), got {type(msg).__name__}")
    return msg
