#!/usr/bin/env python3
"""Sharded loading into a TP-2 instance against the unsharded plan, measured side by side in one run.

Emulated hosts (bench/netlab.py: network namespaces, one tbf-shaped link per host): h0 and h1 hold the source copy
(a host copy with two NICs, the case `sharding.plane_width` admits: a source must drive g links), h2 and h3 are
rank 0 and rank 1 of the TP-2 target, each with its own link and its own data port.
  unsharded: the instance plan as today, every block whole through one link (s0 on h0 -> rank 0 on h2);
  sharded:   the plan's two rank planes (planner `tpgroup.rank_planes`, "parts"): plane r carries bytes
             part_range(size, r, 2) of every block from h_r to rank r on h_{2+r}, both planes at once.
Per rank: bytes received and seconds on the wire (its first byte to its last block verified), each side printed
beside the other -> `tp2_sharded_over_unsharded` (ingest rate of the sharded plan over the unsharded one: the
slowest rank's time counts). Then the ranks' all-gather of the parts (two processes, gloo over loopback: the
stand-in for NVLink; NCCL is not measured here) -> `tp2_gather_s`, and the transfer against the planner's
arithmetic (`tpgroup.ingest_seconds` on the link's goodput) -> `measured_over_predicted_tp2_sharded_transfer`.
`python bench/tptransfer.py [--quick]` writes bench/results/transfer-tp.json; `bench/transfer.py --only tp` too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab
from report import report

from kascade_devcluster.ports import free_ports
from kascade_engine.tp.planes import share_blocks
from kascade_engine.weights.blocks import BlockSet
from kascade_engine.weights.hostcache import write_cache
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import Node, Topology
from kascade_planner.tpgroup import ingest_seconds, rank_planes

GATHER = """
import json, sys, time
import torch.distributed as dist
from kascade_engine.tp.gather import gather_all, my_range
from kascade_engine.weights.hostcache import open_cache
rank, init, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
blocks = open_cache(cache)
man = blocks.manifest()
parts = {b: memoryview(blk.data)[slice(*my_range(blk.nbytes, rank, 2))] for b, blk in blocks.blocks.items()}
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
dist.barrier()
t0 = time.perf_counter()
got = gather_all(man, parts, rank, 2)
dt = time.perf_counter() - t0
assert all(g.verify() for g in got)
print(json.dumps({"rank": rank, "seconds": dt}), flush=True)
"""


def _on_wire(r: dict[str, Any]) -> float:
    return float(r["doneAt"] - r["firstByteAt"])


def gather_seconds(blocks: BlockSet, work: Path) -> float:
    cache = work / "whole.kcache"
    if not cache.exists():
        write_cache(cache, blocks)
    init = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    procs = [subprocess.Popen([sys.executable, "-c", GATHER, str(r), init, str(cache)], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("the gather processes failed")
    return max(json.loads(o.strip().splitlines()[-1])["seconds"] for o in outs)


def tp_section(blocks: BlockSet, chunk: int, rate_mbit: int, work: Path) -> dict[str, float]:
    from transfer import goodput_gbps, run_transfer  # bench/transfer.py: one participant per process

    link = goodput_gbps(rate_mbit)
    topo = Topology((Node("src", "leaf", "src", 2, link), Node("tgt", "leaf", "tgt", 2, link)))
    model = ModelLayout("synthetic", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    whole = make_plan(topo, model, [Instance("s0", "src")], [Instance("t0", "tgt")], "chain", predict=False)
    inst = make_plan(topo, model, [Instance("s0", "src")], [Instance("t0", "tgt", 2)], "chain", shard=False,
                     predict=False)
    planes = rank_planes(inst, 2, "parts")
    out: dict[str, float] = {}
    with netlab.NetLab(4, rate_mbit) as lab:
        h = [(lab.prefix(i), lab.addr(i)) for i in range(4)]
        (work / "whole").mkdir()
        res = run_transfer(whole, blocks, work / "whole", "tcp", chunk, {"s0": h[0], "t0": h[2]})["t0"]
        out["tp2_unsharded_rank0_bytes"] = float(res["bytesReceived"])
        out["tp2_unsharded_rank0_s"] = _on_wire(res)
        results: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []

        def plane(r: int) -> None:
            d = work / f"plane{r}"
            d.mkdir()
            try:
                got = run_transfer(planes[r].plan, share_blocks(blocks, r, 2, "parts"), d, "tcp", chunk,
                                   {"s0": h[r], f"t0.r{r}": h[2 + r]})
                results[r] = got[f"t0.r{r}"]
            except BaseException as e:  # re-raised below
                errors.append(e)

        threads = [threading.Thread(target=plane, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    for r in range(2):
        out[f"tp2_sharded_rank{r}_bytes"] = float(results[r]["bytesReceived"])
        out[f"tp2_sharded_rank{r}_s"] = _on_wire(results[r])
    slowest = max(out["tp2_sharded_rank0_s"], out["tp2_sharded_rank1_s"])
    out["tp2_sharded_bytes_per_rank_over_unsharded"] = (max(out["tp2_sharded_rank0_bytes"],
                                                            out["tp2_sharded_rank1_bytes"])
                                                        / out["tp2_unsharded_rank0_bytes"])
    out["tp2_sharded_over_unsharded"] = out["tp2_unsharded_rank0_s"] / slowest
    predicted = ingest_seconds(blocks.total_bytes, 2, link, 1e9, sharded=True)  # transfer only (no gather)
    out["tp2_sharded_transfer_predicted_s"] = predicted
    out["measured_over_predicted_tp2_sharded_transfer"] = slowest / predicted
    out["tp2_gather_s"] = gather_seconds(blocks, work)
    out["tp2_sharded_plus_gather_over_unsharded"] = out["tp2_unsharded_rank0_s"] / (slowest + out["tp2_gather_s"])
    return out


TARGETS = {"tp2_sharded_over_unsharded": (">=", 1.8), "measured_over_predicted_tp2_sharded_transfer": ("<=", 1.1)}


def main() -> None:
    from transfer import synthetic_blocks

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate-mbit", type=int, default=200)
    a = ap.parse_args()
    blocks = synthetic_blocks((12 if a.quick else 48) << 20, 12)
    with tempfile.TemporaryDirectory() as tmp:
        out = tp_section(blocks, 1 << 20, a.rate_mbit, Path(tmp))
    report("transfer-tp", out, TARGETS)


if __name__ == "__main__":
    main()
