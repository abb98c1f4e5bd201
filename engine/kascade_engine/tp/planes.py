"""Loading a tensor-parallel instance by plan: each rank is its own data-plane participant (its own data port, its
own link) and receives only its share of every block, in its rank plane (planner `tpgroup`: plane r of an
instance plan is an ordinary plan over rank r's shares).

Shares (planner `tpgroup` names them):
  parts  `<block>#r/g`: bytes `part_range(size, r, g)` of the whole block, with their own digest (the relay
         verifies every part as it verifies any block). After the transfer the ranks all-gather the parts
         (gather.py: gloo on CPU, NCCL over NVLink on CUDA), check each whole block's digest and keep their slices.
  slices `<block>@r/g`: rank r's slices packed (slices.py), verified by their own digest and loaded as they are.

Data flow, source side: a whole `BlockSet` -> `share_blocks(blocks, rank, g, mode, layout)` -> the BlockSet a
source's TransferNode for plane r sends from (parts are zero-copy views), and its manifest (`share_manifest`) is
the plane's manifest.
Data flow, matched-TP source (a serving TP-g instance): rank r's `RankModel.slice_set` (the slice blocks it keeps)
-> `serve_slices` (followers; rank 0 in planload.py) -> a TransferNode on rank r's data port for plane r.
Data flow, rank side: a `PlaneSpec` (plane transfer spec + this rank's participant id + the whole manifest) ->
`receive_plane` (a TransferNode on this rank's data port; returns the verified shares and the rank's bytes and
seconds) -> `install` (parts: the all-gather, in manifest order on every rank; slices: as they are) ->
`RankModel` complete -> `exchange_stats` gives rank 0 every rank's bytes and seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import SpecError, TransferSpec
from kascade_engine.net.transport import Transport
from kascade_engine.net.transports import make_transport
from kascade_engine.tp.gather import gather_block
from kascade_engine.tp.rankmodel import RankModel
from kascade_engine.tp.shard import TPLayout
from kascade_engine.tp.slices import slice_block
from kascade_engine.weights.blocks import Block, BlockSet, digest_of
from kascade_planner.plan import Plan
from kascade_planner.tpgroup import Mode, part_id, part_range, plane_plan, slice_id

log = logging.getLogger(__name__)


def share_blocks(blocks: BlockSet, rank: int, g: int, mode: Mode, layout: TPLayout | None = None) -> BlockSet:
    """Rank `rank`'s share of every block of `blocks`, as blocks of their own (empty parts are left out)."""
    out: list[Block] = []
    for b in blocks.blocks.values():
        if mode == "slices":
            if layout is None or layout.tp != g:
                raise ValueError(f"layout: slices need the tp {g} layout")
            out.append(slice_block(layout, rank, b))
            continue
        lo, hi = part_range(b.nbytes, rank, g)
        if hi > lo:
            view = memoryview(b.data)[lo:hi]
            out.append(Block(part_id(b.id, rank, g), view, (), digest_of(view)))
    return BlockSet(blocks.model, blocks.config, out)


def share_manifest(blocks: BlockSet, rank: int, g: int, mode: Mode, layout: TPLayout | None = None
                   ) -> dict[str, dict[str, Any]]:
    return share_blocks(blocks, rank, g, mode, layout).manifest()


@dataclass(frozen=True)
class PlaneSpec:
    """What one rank needs to load by plan: its plane's transfer spec, its participant id there, the share kind,
    and the whole blocks' manifest (sizes, digests, tensor index: the gather checks and splits by it)."""

    spec: TransferSpec
    me: str
    mode: Mode
    whole: Mapping[str, Mapping[str, Any]]
    transport: str = "tcp"

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "me": self.me, "mode": self.mode, "whole": dict(self.whole),
                "transport": self.transport}

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> PlaneSpec:
        mode = str(doc.get("mode"))
        if mode not in ("slices", "parts"):
            raise ValueError(f"mode: expected slices or parts, got {mode!r}")
        return PlaneSpec(TransferSpec.from_dict(doc["spec"]), str(doc["me"]), "slices" if mode == "slices" else
                         "parts", dict(doc["whole"]), str(doc.get("transport", "tcp")))

    @staticmethod
    def read(path: Path) -> PlaneSpec:
        return PlaneSpec.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class Plane:
    """One rank plane, ready to run: its transfer spec, and the blocks its sources send from."""

    rank: int
    spec: TransferSpec
    source_blocks: BlockSet


def build_planes(plan: Plan, blocks: BlockSet, g: int, mode: Mode, token: str,
                 address: Callable[[str, int], tuple[str, int]], chunk_bytes: int = 1 << 20,
                 timeout_s: float = 10.0) -> list[Plane]:
    """The g planes of instance plan `plan` (unsharded, into TP-g targets) from a source holding the whole
    `blocks`. `address(participant, rank)`: the data address of a participant in plane `rank` (a rank's own
    port; a TP-1 source feeding several planes listens once per plane)."""
    layout = TPLayout.of(blocks.config, g) if mode == "slices" else None
    out: list[Plane] = []
    for r in range(g):
        share = share_blocks(blocks, r, g, mode, layout)
        rp = plane_plan(plan, r, g, mode, {b.id: b.nbytes for b in share.blocks.values()})
        peers = {i.id: address(i.id, r) for i in (*rp.sources, *rp.targets)}
        spec = TransferSpec(rp, share.manifest(), peers, token, chunk_bytes, timeout_s)
        out.append(Plane(r, spec, share))
    return out


def derive_planes(spec: TransferSpec, g: int, manifests: Sequence[Mapping[str, Any]] | None = None,
                  mode: Mode = "parts") -> list[TransferSpec]:
    """The g planes of an instance plan's spec, as every participant derives them alike: plane r's plan
    (`tpgroup.plane_plan`), each participant at its instance's data port + r (rank r of a TP instance listens
    there; a TP-1 source feeding g planes listens once per plane), the same token, chunk size and timeouts.
    Share digests (and, for slices, sizes) come from `manifests[r]` (a source: its own shares) or from the spec's
    manifest, which then holds the share entries (`GET manifest?parts=g` of the source: parts from a source holding
    whole blocks, every rank's slices from a TP-g source). A missing share entry is a SpecError."""
    out: list[TransferSpec] = []
    for r in range(g):
        src = manifests[r] if manifests is not None else spec.manifest
        sizes = None
        if mode == "slices":
            want = [slice_id(b, r, g) for b in spec.plan.model.block_ids]
            missing = [b for b in want if b not in src]
            if missing:
                raise SpecError(f"manifest: no entry for slice {missing[0]!r} (ask the TP-{g} source for "
                                f"manifest?parts={g})")
            sizes = {b: int(src[b]["bytes"]) for b in want}
        rp = plane_plan(spec.plan, r, g, mode, sizes)
        missing = [b for b in rp.model.block_ids if b not in src]
        if missing:
            raise SpecError(f"manifest: no entry for part {missing[0]!r} (ask the source for manifest?parts={g})")
        peers: dict[str, tuple[str, int]] = {}
        for i in (*rp.sources, *rp.targets):
            base = i.id.removesuffix(f".r{r}") if i.id not in spec.peers else i.id
            if base not in spec.peers:
                raise SpecError(f"peers lacks an address for {base!r}")
            host, port = spec.peers[base]
            peers[i.id] = (host, port + r)
        out.append(TransferSpec(rp, {b: src[b] for b in rp.model.block_ids}, peers, spec.token, spec.chunk_bytes,
                                spec.timeout_s, spec.faults, spec.not_before))
    return out


def manifest_with_parts(blocks: BlockSet, g: int) -> dict[str, dict[str, Any]]:
    """The whole blocks' manifest plus every part entry of every rank plane at `g` (what targets need)."""
    out = blocks.manifest()
    for r in range(g):
        out.update(share_manifest(blocks, r, g, "parts"))
    return out


@dataclass(frozen=True)
class Received:
    shares: Mapping[str, Block]
    bytes_in: int
    seconds: float  # first byte to the last share resident (the rank's own link), or wall time when none


async def receive_plane(ps: PlaneSpec, transport: Transport | None = None,
                        on_event: Callable[[dict[str, Any], Mapping[str, Block]], None] | None = None) -> Received:
    """Run this rank's TransferNode for its plane (listening on its own data port) until every share is
    resident and verified; a failed transfer raises TransferFailed naming what failed. `on_event`: each
    progress event with the shares resident so far (a layer-by-layer load installs them as they land)."""
    node: TransferNode | None = None

    def progress(event: dict[str, Any]) -> None:
        if on_event is not None and node is not None:
            on_event(event, node.resident)

    node = TransferNode(ps.spec, ps.me, transport or make_transport(ps.transport), on_progress=progress)
    started = time.time()
    await node.start()
    try:
        summary = await node.run()
    finally:
        await node.close()
    first = summary.get("firstByteAt") or started
    seconds = float((summary.get("doneAt") or time.time()) - first)
    return Received(dict(node.resident), int(summary["bytesReceived"]), seconds)


def receive_plane_sync(ps: PlaneSpec) -> Received:
    return asyncio.run(receive_plane(ps))


def install(model: RankModel, ps: PlaneSpec, got: Received, group: dist.ProcessGroup | None = None,
            device: torch.device | None = None, keep: list[Block] | None = None) -> float:
    """Make `model` complete from this rank's shares; returns the seconds spent gathering (0 for slices).
    Parts: every rank calls this (a collective per block, in the whole manifest's order); each block's digest is
    checked after the gather (GatherError names it; nothing of it is added). `keep`: the gathered whole blocks
    are appended to it (rank 0 keeps them: a source of the next plan)."""
    g, rank = model.layout.tp, model.rank
    if ps.mode == "slices":
        for bid in ps.whole:
            sid = slice_id(bid, rank, g)
            # a plane leaves out empty slices (the LM head on ranks > 0); every other one is resident here, since
            # `receive_plane` returned (the relay ends only with every block of its plan verified)
            model.add_sliced(got.shares.get(sid) or Block(sid, memoryview(b""), (), digest_of(b"")))
        return 0.0
    t0 = time.perf_counter()
    for bid, entry in ps.whole.items():
        part = got.shares.get(part_id(bid, rank, g))
        whole = gather_block(bid, entry, part.data if part is not None else b"", rank, g, group, device)
        model.add_block(bid, whole.tensors())
        if keep is not None:
            keep.append(whole)
    return time.perf_counter() - t0


class PlaneFailed(RuntimeError):
    """A rank's plane did not complete: the load failed (progressive.py), the instance is whole."""


def serve_slices(model: RankModel, ps: PlaneSpec, after: threading.Thread | None = None) -> threading.Thread:
    """A follower of a matched-TP source: send this rank's slice blocks in its plane from its own data port, in a
    thread of its own (its own asyncio loop), while the rank goes on following rank 0's steps. A failure is logged
    here; the plan's targets see it as a failed transfer (their own plane fails, so the whole target fails).
    `after`: this rank's previous serve. It may still hold the data port (rank 0 finished its own share of that plan
    and took the next, while this rank still retries a target that died before it connected, for up to the plan's
    timeout): the next serve waits for it to end rather than fail on a port in use; the next plan's targets wait
    for their upstream and pull from it (their fallback) once it listens."""
    blocks = model.slice_set(ps.spec.plan.model.name)

    async def run() -> None:
        node = TransferNode(ps.spec, ps.me, make_transport(ps.transport), blocks=blocks)
        await node.start()
        try:
            summary = await node.run()
            log.info("%s: sent its slices: %s", ps.me, summary)
        finally:
            await node.close()

    def main() -> None:
        if after is not None and after.is_alive():
            log.info("%s: waiting for this rank's previous serve to leave the data port", ps.me)
            after.join()
        try:
            asyncio.run(run())
        except Exception as e:  # a target gone, the port in use: the targets' planes fail and say so
            log.error("%s: sending its slices failed: %s", ps.me, e)

    t = threading.Thread(target=main, daemon=True, name=f"tp-serve-{model.rank}")
    t.start()
    return t


def exchange_stats(got: Received, gather_s: float, rank: int, tp: int,
                   group: dist.ProcessGroup | None = None) -> Sequence[Mapping[str, float]]:
    """Every rank's {rank, bytes, seconds, gatherSeconds}, on every rank (a collective)."""
    mine = {"rank": float(rank), "bytes": float(got.bytes_in), "seconds": got.seconds, "gatherSeconds": gather_s}
    out: list[Any] = [None] * tp
    dist.all_gather_object(out, mine, group=group)
    return [dict(x) for x in out]
