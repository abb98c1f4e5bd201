"""A load plan whose targets are tensor-parallel (`gpus` g > 1) run as g rank planes (planes.py, planner `tpgroup`),
on the engines the operator calls exactly as for any plan: the same `load-plan` body, the instance plan unsharded.
Every participant decides the share kind from the plan alone (`tpgroup.instance_mode`): "slices" when every source
is a TP-g GPU instance (matched TP), else "parts".

Target (rank 0 of a TP-g engine started with `--tp g --empty`): derive the planes -> send every follower its plane
(`TPEngine.load_planes`, the step channel; it receives it on data port + r in the background and goes on following
steps) -> receive plane 0 on this process's data port + 0 (every share's digest verified by the relay before it is
kept) -> layer by layer (progressive.py): poll every rank's verified shares, install the blocks every rank holds on
every rank at once (parts: the all-gather, each whole block's digest checked, gather.py; slices: as they are), so the
instance serves its resident prefix (with a live pair) while it loads. A failed plane on any rank fails the load on
every rank, naming it (the instance stays up with the load error, the operator releases it for the next plan); a
rank that is gone, or a failed gather, fails the instance: it exits 3 and the pod is replaced. Parts: rank 0 also
keeps the whole blocks as its `blockset` (a source of any next plan); slices: only the whole blocks' manifest.
Either way every rank keeps its slice blocks (`RankModel.slices`), so the instance can source a matched-TP plan.
Source, parts (a TP-1 engine, or rank 0 of a TP-g instance holding whole blocks): one TransferNode per plane,
plane r on its data port + r, sending the parts of plane r (zero-copy views of its blocks, digests computed here).
Source, slices (a serving TP-g instance): rank 0 asks every rank's slice manifest (`TPEngine.slice_manifests`),
derives the planes, sends the followers `Serve` (each sends its slice blocks in its plane from data port + r, in
the background, while it goes on following steps) and sends plane 0 itself.
Share digests targets verify come with the plan's manifest (`GET manifest?parts=g` of the source: part entries
from a source of whole blocks, every rank's slice entries from a TP-g source).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from kascade_engine.net.pacing import paced
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.tp.planes import PlaneFailed, PlaneSpec, derive_planes, share_blocks
from kascade_engine.tp.progressive import PlaneReceiver, common_ready, failures, install_ready
from kascade_engine.weights.blocks import Block, BlockSet
from kascade_planner.tpgroup import Mode, instance_mode, rank_id

log = logging.getLogger(__name__)


class PlanRefused(ValueError):
    """A load plan this engine cannot run as rank planes: the loader answers `status` naming `field`."""

    def __init__(self, status: int, message: str, field: str) -> None:
        super().__init__(message)
        self.status, self.field = status, field


def plane_width(spec: TransferSpec) -> int:
    """g when the plan is an unsharded instance plan into TP-g targets (run as rank planes), else 1."""
    widths = {t.gpus for t in spec.plan.targets if t.kind == "gpu"}
    if len(widths) != 1 or any(f.shard for f in spec.plan.flows):
        return 1
    return widths.pop()


def followers_load_path(inst: Any, directory: Path) -> None:
    """The first copy from a checkpoint directory into a TP engine: ranks 1..g-1 pack it too and keep their
    slices (rank 0 packs it in the loader); a follower that cannot fails the instance (it exits 3)."""
    if inst.config.tp > 1:
        inst.ranks.engine.load_path(str(directory))


def _me_in(plane: TransferSpec, me: str, rank: int) -> str:
    ids = {i.id for i in (*plane.plan.sources, *plane.plan.targets)}
    return rank_id(me, rank) if rank_id(me, rank) in ids else me


async def start_tp_plan(inst: Any, spec: TransferSpec, me: str, g: int, is_target: bool,
                        blocks: BlockSet | None) -> None:
    """Start this engine's part of a plan into TP-g targets (see the module docstring); returns once listening.
    `blocks`: the whole blocks this engine holds (a TP-1 source, or rank 0 of a TP-g instance that kept them)."""
    tp = inst.config.tp
    if is_target and tp != g:
        raise PlanRefused(409, f"tp: this engine runs {tp} ranks, the plan's targets have {g} GPUs",
                          "plan.targets")
    try:
        mode = instance_mode(spec.plan, g)
        if is_target:
            specs = derive_planes(spec, g, mode=mode)
        elif mode == "slices":  # this engine is a TP-g source: rank r sends its own slices on data port + r
            if tp != g:
                raise PlanRefused(409, f"tp: the plan names this engine a source of {g} GPUs, it runs {tp} ranks",
                                  "plan.sources")
            if not inst.model.complete:
                raise PlanRefused(409, "this engine is a source of the plan but holds no complete copy", "plan")
            manifest = await asyncio.to_thread(inst.ranks.engine.slice_manifests, inst.config.model_name)
            specs = derive_planes(spec, g, [manifest] * g, mode="slices")
        else:
            if blocks is None:
                why = (f" (a TP-{tp} instance loaded from a TP-{tp} source holds only its ranks' slices: it can be "
                       f"the source of TP-{tp} targets only)") if tp > 1 and inst.model.complete else ""
                raise PlanRefused(409, f"this engine is a source of the plan but holds no complete copy{why}", "plan")
            shares = [share_blocks(blocks, r, g, "parts") for r in range(g)]
            specs = derive_planes(spec, g, [s.manifest() for s in shares])
    except PlanRefused:
        raise
    except ValueError as e:  # SpecError, PlanError: the body is wrong, say which field
        raise PlanRefused(400, f"invalid load plan for tp {g}: {e}", "plan") from None
    inst.instance_id = me
    if is_target:
        await _target(inst, spec, specs, me, g, mode)
    elif mode == "slices":
        await _source_slices(inst, specs, me)
    else:
        await _source(inst, specs, me, shares)


async def _source_slices(inst: Any, specs: list[TransferSpec], me: str) -> None:
    """Matched TP: every follower sends its slices in its plane (in the background: it goes on serving), rank 0
    sends its own in plane 0 from here."""
    docs = [PlaneSpec(s, _me_in(s, me, r), "slices", {}, inst.config.transport) for r, s in enumerate(specs)]
    own = inst.model.slice_set(inst.config.model_name)
    node = TransferNode(specs[0], docs[0].me, paced(inst.config.weight_transport(), inst.egress), blocks=own)
    await node.start()
    await asyncio.to_thread(inst.ranks.engine.serve_planes, [d.to_dict() for d in docs])

    async def run() -> None:
        try:
            log.info("%s: sent its slices (rank 0): %s", me, await node.run())
        except Exception as e:
            log.error("rank 0's slices from %s failed: %s", me, e)
            inst.load_error = str(e)
            inst.transfer_failures += 1
        finally:
            await node.close()

    inst.loading = asyncio.create_task(run())


async def _source(inst: Any, specs: list[TransferSpec], me: str, shares: list[BlockSet]) -> None:
    nodes = [TransferNode(s, _me_in(s, me, r), paced(inst.config.weight_transport(), inst.egress), blocks=shares[r])
             for r, s in enumerate(specs)]
    for n in nodes:
        await n.start()

    async def run() -> None:
        try:
            done = await asyncio.gather(*(n.run() for n in nodes))
            log.info("%s: fed %d rank planes: %s", me, len(nodes), done)
        except Exception as e:
            log.error("rank planes from %s failed: %s", me, e)
            inst.load_error = str(e)
            inst.transfer_failures += 1
        finally:
            for n in nodes:
                await n.close()

    inst.loading = asyncio.create_task(run())


POLL_S = 0.1  # how often rank 0 asks every rank how far its plane got while a load runs (one small collective)


async def _target(inst: Any, spec: TransferSpec, specs: list[TransferSpec], me: str, g: int, mode: Mode) -> None:
    ids = spec.plan.model.block_ids
    whole = {b: spec.manifest[b] for b in ids} if mode == "parts" else {b: spec.manifest.get(b, {}) for b in ids}
    docs = [PlaneSpec(specs[r], rank_id(me, r), mode, whole, inst.config.transport) for r in range(g)]
    engine, model = inst.ranks.engine, inst.model
    control = engine.group.control
    load = engine.load_planes([d.to_dict() for d in docs])  # the followers receive theirs beside their step loop
    rx = PlaneReceiver(docs[0], 0, g)
    started = time.monotonic()

    async def run() -> None:
        receiving = asyncio.create_task(rx.run(inst.config.weight_transport()))
        keep: list[Block] = []
        installed: set[str] = set()
        try:
            while True:
                if receiving.done():
                    await asyncio.sleep(POLL_S)
                else:  # rank 0's own plane may end first: then poll at once
                    await asyncio.wait([receiving], timeout=POLL_S)
                reports = await asyncio.to_thread(engine.load_progress, rx.report())
                bad = failures(reports)
                if bad is not None:
                    raise PlaneFailed(bad)
                ready = common_ready(reports, ids, installed)
                if ready:  # every rank holds its share of these: install them everywhere, now
                    here = partial(install_ready, model, rx, ready, control, model.device,
                                   keep if mode == "parts" else None)
                    await asyncio.to_thread(engine.install_blocks, ready, here)
                    installed.update(ready)
                    inst.bytes_received = rx.bytes_in
                    if len(installed) < len(ids):  # the phase follows residency (live: it serves its prefix); the
                        inst.add_block(None)  # last blocks' settle comes below, with the blockset a source needs
                if len(installed) == len(ids) and all(r["done"] for r in reports):
                    break
            reports = await asyncio.to_thread(engine.load_progress, rx.report())  # the last installs' gather time
        except PlaneFailed as e:  # a rank's plane failed: every rank stops; the instance is whole, the load failed
            # (as a TP-1 target's: loadError, the blocks installed so far stay, the operator drops and releases it)
            log.error("tensor-parallel load into %s failed (%d of %d blocks installed): %s", me, len(installed),
                      len(ids), e)
            receiving.cancel()
            await asyncio.to_thread(engine.abort_load, str(e), load)
            inst.load_error = str(e)
            inst.transfer_failures += 1
            return
        except asyncio.CancelledError:  # released while loading: the followers stop receiving too
            receiving.cancel()  # (a thread: this task is cancelled; the next Load cancels it anyway)
            threading.Thread(target=engine.abort_load, args=("the load was cancelled", load), daemon=True,
                             name="tp-abort").start()
            raise
        except Exception as e:  # GatherError, a rank gone: the ranks may disagree on what they hold, so it exits
            log.error("tensor-parallel load into %s failed: %s", me, e)
            inst.load_error = str(e)
            inst.transfer_failures += 1
            engine.lost(f"load plan failed: {e}")
            return
        stats = [{k: float(r[k]) for k in ("rank", "bytes", "seconds", "gatherSeconds")} for r in reports]
        inst.bytes_received = rx.bytes_in
        inst.transfer_bw = rx.bytes_in / max(1e-6, time.monotonic() - started)
        inst.tp_load_stats = stats
        # parts: rank 0 keeps the gathered whole blocks (a source of any next plan); slices: only its own slices
        # (a source of matched-TP plans: every rank sends its own), and the whole blocks' manifest, if it came
        inst.blockset = BlockSet(inst.config.model_name, model.full_cfg, keep) if keep else None
        inst.tp_whole_manifest = {b: e for b, e in whole.items() if e} or None
        inst.settle()
        log.info("%s: %d ranks loaded by plan: %s", me, g, stats)

    inst.loading = asyncio.create_task(run())
    inst.plan = spec.to_dict()
    inst.begin_loading()

