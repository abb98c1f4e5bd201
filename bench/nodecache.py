#!/usr/bin/env python3
"""Host memory per node with 1, 2 and 4 engines of one model (issue 35 item 3, ADR 16), read from /proc.

One model (a random Llama checkpoint built here, packed into verified blocks by the engine's `pack_checkpoint`)
is published once into a node cache on /dev/shm (`kascade_engine.weights.nodecache`). Then N engine processes
each take the weights the way the engine does (`Block.tensors()`: torch views of the block buffers) and read
every byte (a sum over every tensor), either
- `node-cache`: from the node's copy, mapped (`NodeCache.attach`), or
- `private`: each copying the blocks into its own memory first (one host copy per replica, as a serving engine
  keeps its host buffers today).
With every process holding its weights, the parent reads each one's /proc/<pid>/status (RssAnon: private memory,
RssShmem: pages of the shared copy it maps) and smaps_rollup (Pss: its fair share), and /proc/meminfo Shmem
(the node's shared memory, counted once). The processes are engine-like (the engine's weight path and torch),
not engine servers: the HTTP server, KV cache and batcher add the same private memory in both cases.

Usage: python bench/nodecache.py [--layers 4 --hidden 1024 --vocab 16000] [--counts 1 2 4]
Writes bench/results/nodecache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
WORKER = textwrap.dedent("""
    import sys
    import torch
    from kascade_engine.weights.hostcache import open_cache
    from kascade_engine.weights.nodecache import NodeCache
    from kascade_engine.weights.blocks import Block
    root, model, mode = sys.argv[1:4]
    if mode == "node-cache":
        lease = NodeCache(root, 1 << 40).attach(model)
        blocks = list(lease.blocks.blocks.values())
    else:  # private: this process's own copy of every block
        cached = open_cache(NodeCache(root, 1 << 40).path(model))
        blocks = [Block(b.id, memoryview(bytearray(b.data)), b.index, b.digest) for b in cached.blocks.values()]
        del cached
    total = 0.0
    for b in blocks:
        for t in b.tensors().values():
            total += float(t.double().sum()) if t.is_floating_point() else float(t.sum())
    print("ready", total, flush=True)
    sys.stdin.read()
""")


def _kib(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure(root: Path, model: str, mode: str, n: int) -> dict[str, Any]:
    shmem0 = _kib(Path("/proc/meminfo").read_text(), "Shmem")
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), model, mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    try:
        sums = set()
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().split()
            if not line or line[0] != "ready":
                raise RuntimeError(f"worker {p.pid} failed (exit {p.poll()})")
            sums.add(line[1])
        per = []
        for p in procs:
            status = Path(f"/proc/{p.pid}/status").read_text()
            rollup = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
            per.append({k: _kib(status, k) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
                       | {"Pss": _kib(rollup, "Pss") / 1024})
        shmem = _kib(Path("/proc/meminfo").read_text(), "Shmem")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {"mode": mode, "engines": n, "same_weights": len(sums) == 1, "per_engine_mib": per,
            "rss_anon_total_mib": sum(x["RssAnon"] for x in per),
            "rss_shmem_total_mib": sum(x["RssShmem"] for x in per),
            "pss_total_mib": sum(x["Pss"] for x in per), "node_shmem_mib": shmem / 1024,
            "node_shmem_delta_mib": (shmem - shmem0) / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", type=Path, default=RESULTS / "nodecache.json")
    args = ap.parse_args()
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_engine.weights.checkpoint import tiny_llama
    from kascade_engine.weights.nodecache import NodeCache

    work = Path(tempfile.mkdtemp(prefix="kascade-nodecache-"))
    root = Path(tempfile.mkdtemp(prefix="kascade-nodecache-", dir="/dev/shm"))
    try:
        blocks = pack_checkpoint(tiny_llama(work / "ckpt", layers=args.layers, hidden=args.hidden, vocab=args.vocab),
                                 "bench-llama")
        model_mib = blocks.total_bytes / (1 << 20)
        shmem_before = _kib(Path("/proc/meminfo").read_text(), "Shmem") / 1024
        ok, why = NodeCache(root, 1 << 40).publish(blocks)
        if not ok:
            raise SystemExit(why)
        del blocks
        shmem_copy = _kib(Path("/proc/meminfo").read_text(), "Shmem") / 1024 - shmem_before
        print(f"model: {model_mib:.0f} MiB of weights; the node copy added {shmem_copy:.0f} MiB of Shmem "
              f"(/proc/meminfo)")
        rows = []
        print(f"{'mode':11s} {'engines':>7s} {'RssAnon sum':>11s} {'RssShmem sum':>12s} {'Pss sum':>8s} "
              f"{'node Shmem':>10s}  (MiB, /proc)")
        for mode in ("node-cache", "private"):
            for n in args.counts:
                r = measure(root, "bench-llama", mode, n)
                rows.append(r)
                print(f"{mode:11s} {n:7d} {r['rss_anon_total_mib']:11.0f} {r['rss_shmem_total_mib']:12.0f} "
                      f"{r['pss_total_mib']:8.0f} {r['node_shmem_mib']:10.0f}"
                      + ("" if r["same_weights"] else "  (weights differ between engines!)"))
        out = {"model_mib": model_mib, "node_copy_shmem_mib": shmem_copy, "runs": rows,
               "note": "engine-like processes: the engine's Block.tensors() weight path under torch, not servers"}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
