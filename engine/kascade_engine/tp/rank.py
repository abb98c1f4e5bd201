"""A follower rank's process (ranks 1..tp-1 of a tensor-parallel instance): `python -m kascade_engine.tp.rank`.

Data flow: the checkpoint's blocks -> its slices (rankmodel.py) -> join the group (group.py; blocks until every
rank is in) -> barrier (every rank loaded) -> loop: rank 0's step message (step.py) -> `build_batch` over its own
paged KV cache with rank 0's page tables -> embed -> every layer (its heads and MLP slice, all-reducing with the
other ranks) -> next message; no logits (only rank 0 samples). `Load`: receive this rank's plane of a plan, in the
background (progressive.py: the rank goes on following steps); `Progress` / `Install` / `Abort`: rank 0 asks how far
it got, installs the blocks every rank holds, gives the load up; `Serve`: send this rank's slices in its plane
(matched TP, a background thread); `Manifests`: say this rank's slice
manifest; `GatherKV` / `ScatterKV`: a request's KV heads of this rank to / from rank 0 (disaggregated serving,
kv.py); `Layers`: a live pair's partial forward (a layer range over rank 0's hidden states, leader.py). `Stop`
ends it with 0; a failed collective (a rank or rank 0 gone) ends it with 3, the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from kascade_engine.batch.kvcache import KVCache, build_batch
from kascade_engine.batch.scheduler import Limits
from kascade_engine.tp import kv, planes, progressive
from kascade_engine.tp import step as msg
from kascade_engine.tp.group import RankGroup, join
from kascade_engine.tp.rankmodel import RankModel
from kascade_engine.tp.shard import TPLayout
from kascade_engine.weights.blocks import pack_checkpoint

log = logging.getLogger("kascade_engine.tp.rank")

EXIT_LOST = 3  # a collective failed: another rank (or rank 0) is gone


def exit_lost() -> NoReturn:
    """Every rank's way out once another is gone (rank 0: launch.exit_on_lost, run.py; a follower: main): at once,
    with EXIT_LOST. The interpreter's teardown of a gloo group whose peer died may abort the process (SIGABRT,
    "terminate called without an active exception": exit -6, not 3, once in a CI run under load) and a thread may
    still wait on a collective or a data port."""
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_LOST)


def follow(model: RankModel, cache: KVCache, group: RankGroup) -> str:
    """Run rank 0's steps until it says stop; returns its reason."""
    model.reduce = group.reduce
    L = model.shape.layers
    serving: threading.Thread | None = None  # this rank's latest Serve (they take turns on its data port)
    loading: progressive.PlaneReceiver | None = None  # this rank's latest plane received by plan
    loads = 0  # Load messages received (an Abort names the one it gives up)
    while True:
        m = msg.receive(group.control)
        if isinstance(m, msg.Stop):
            return m.reason
        if isinstance(m, msg.Load):  # rank 0 got a load plan: this rank's plane, received beside the step loop
            if loading is not None:  # the previous plan's receive leaves the data port first (it ended or was aborted)
                loading.cancel()
                if loading.thread is not None:
                    loading.thread.join()
            loading = progressive.PlaneReceiver(planes.PlaneSpec.from_dict(m.planes[group.rank]), group.rank,
                                                group.tp)
            loading.start_thread()
            loads += 1
            continue
        if isinstance(m, msg.Progress):  # rank 0 asks how far every rank's plane got
            report = loading.report() if loading is not None else {"rank": group.rank, "ready": [],
                                                                    "error": "no load plan here", "done": False}
            dist.all_gather_object([None] * group.tp, report, group=group.control)
            continue
        if isinstance(m, msg.Install):  # blocks every rank holds its share of: install them (parts: the gather)
            assert loading is not None, "Install without a load plan"
            progressive.install_ready(model, loading, m.blocks, group.control, model.device)
            continue
        if isinstance(m, msg.Abort):  # the load failed on some rank: stop receiving (what was installed stays)
            if loading is not None and m.load == loads:
                loading.cancel()
                log.warning("load plan given up: %s", m.reason)
            continue
        if isinstance(m, msg.LoadPath):  # the first copy, from the volume every rank of the pod mounts
            model.add_blocks(pack_checkpoint(m.path).blocks.values())
            continue
        if isinstance(m, msg.Manifests):  # rank 0 asks every rank's slice manifest (a matched-TP source's)
            dist.all_gather_object([None] * group.tp, model.slice_set(m.model).manifest(), group=group.control)
            continue
        if isinstance(m, msg.Serve):  # matched TP, this instance a source: send this rank's slices, meanwhile follow
            serving = planes.serve_slices(model, planes.PlaneSpec.from_dict(m.planes[group.rank]), after=serving)
            continue
        if isinstance(m, msg.GatherKV):  # a prefill engine's KV leaves from rank 0: this rank's heads go there
            kv.give(cache, m.slots, group.control)
            continue
        if isinstance(m, msg.ScatterKV):  # a decode engine's KV landed on rank 0: this rank's heads come here
            kv.take(cache, m.slots, group.control)
            continue
        if isinstance(m, msg.Layers):  # a live pair's partial forward: rank 0's hidden states, a layer range
            model.run_layers(m.first, m.last, m.hidden.to(model.device, model.dtype), build_batch(cache, m.items))
            continue
        batch = build_batch(cache, m.items)
        model.run_layers(0, L, model.embed(torch.tensor(m.ids, dtype=torch.long, device=model.device)), batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kascade_engine.tp.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--init", required=True, help="rendezvous, tcp://host:port (rank 0 listens)")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--plane", type=Path, help="load by plan: this rank's plane spec (planes.py; JSON), not the "
                   "checkpoint's weights (the checkpoint then gives the config only)")
    p.add_argument("--resident-layers", type=int, help="keep only embed and this many leading layers of the "
                   "checkpoint (a load in progress: live pairing's tests and demos)")
    p.add_argument("--empty", action="store_true", help="start with no weights: they arrive by plan (rank 0 sends "
                   "this rank its plane spec; the checkpoint gives the config only)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank {a.rank}: %(message)s")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    plane = planes.PlaneSpec.read(a.plane) if a.plane else None
    got = planes.receive_plane_sync(plane) if plane else None  # this rank's link, before the group meets
    by_plan = plane is not None or a.empty
    blocks = None if by_plan else pack_checkpoint(a.checkpoint)
    cfg: dict[str, Any] = json.loads((a.checkpoint / "config.json").read_text()) if blocks is None else blocks.config
    layout = TPLayout.of(cfg, a.tp)
    model = RankModel(cfg, layout, a.rank, dtype=getattr(torch, a.dtype), device=device)
    if blocks is not None:
        keep = None if a.resident_layers is None else {"embed", *(f"layer.{i}" for i in range(a.resident_layers))}
        model.add_blocks(b for b in blocks.blocks.values() if keep is None or b.id in keep)
    s = model.shape
    limits = Limits(kv_tokens=a.kv_tokens, page_size=a.page_size)
    cache = KVCache(s.layers, limits.pages, limits.page_size, s.kv_heads, s.head_dim, model.dtype, device,
                    reuse_gather=True)
    group = join(a.rank, a.tp, a.init, device, a.timeout_s)
    try:
        if plane is not None and got is not None:
            gather_s = planes.install(model, plane, got, device=device)  # parts: the all-gather with every rank
            planes.exchange_stats(got, gather_s, a.rank, a.tp, group.control)
        group.barrier()  # every rank holds its weights
        reason = follow(model, cache, group)
    except RuntimeError as e:
        print(f"rank {a.rank}: tensor-parallel instance broken: {e}", file=sys.stderr, flush=True)
        exit_lost()
    log.info("stopped: %s", reason)
    group.close()  # before the interpreter's teardown, which may abort on a group still alive (exit_lost)
    return 0


if __name__ == "__main__":
    sys.exit(main())
