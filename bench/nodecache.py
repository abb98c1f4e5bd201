#!/usr/bin/env python3
"""Host memory per node with 1, 2 and 4 real engine replicas of one model (issue 35 item 3, ADR 16), from /proc.

One "node" is this host. For each mode and replica count N, N real engine processes (`kascade engine serve
--checkpoint <ckpt>`, as the tests start them) serve one model (a random Llama built here), each answers one
completion (every layer's weights are read), and with all N holding their weights the bench reads
/proc/<pid>/status (RssAnon, RssShmem) and smaps_rollup (Pss) of each, and the bytes of the node cache directory
(a tmpfs: resident in full). Modes:
- `node-cache`: every engine has `--node-cache-dir` on one /dev/shm directory: the first packs the checkpoint and
  publishes the node's copy, the others map it; the node's host memory for weights is that one file.
- `private`: no node cache: every engine packs the checkpoint into its own memory (one host copy per replica).
`--load plan`: only the first engine reads the checkpoint; the others start `--empty` and load every block by a
load plan from it (the scale-up path: received into private buffers, then, with the node cache, swapped for the
node's copy).
An `--empty` engine (no weights) gives each process's own memory (torch, interpreter, buffers): `weights` =
node memory - N x that baseline, where node memory = sum of RssAnon + the node cache's bytes. `copies` =
weights / the model's bytes: ~1 with the node cache whatever N, ~N without.

Usage: python bench/nodecache.py [--layers 4 --hidden 1024 --vocab 16000] [--counts 1 2 4] [--load source|plan]
Prints hostmem_<N>_replicas_over_1 per mode side by side; writes bench/results/nodecache.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path[:0] = [str(ROOT / d) for d in ("tests/engine", "engine", "cli", "e2e", "planner")]


def by_plan(src: Any, dst: Any, manifest: dict[str, Any]) -> None:
    """`dst` (an --empty engine) loads every block from `src` by a one-hop load plan, until it serves."""
    import time

    import httpx

    from kascade_devcluster.ports import free_ports
    from kascade_planner.baselines import build_star
    from kascade_planner.plan import Instance, ModelLayout

    layout = ModelLayout("bench-llama", tuple(manifest), tuple(int(m["bytes"]) for m in manifest.values()))
    plan = build_star(layout, [Instance("a", "n0")], [Instance("b", "n0")]).to_dict()
    pa, pb = free_ports(2)
    doc = {"plan": plan, "peers": {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}, "planToken": "pt"}
    h = {"Authorization": f"Bearer {dst.token}"}
    httpx.post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "b", "manifest": manifest},
               headers=h, timeout=60).raise_for_status()
    httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "a"}, headers=h,
               timeout=60).raise_for_status()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = httpx.get(dst.url + "/kascade/v1/status", headers=h, timeout=60).json()
        if st["loadError"]:
            raise RuntimeError(st["loadError"])
        if st["ready"] and (st.get("nodeCopy") or "--node-cache-dir" not in dst.proc.args):
            return
        time.sleep(0.05)
    raise RuntimeError("the plan load never finished")


def run(ckpt: Path, cache: Path | None, n: int, load: str = "source") -> dict[str, Any]:
    import httpx
    from conftest import start_engine  # the tests' real-engine starter

    from kascade_devcluster.procmem import dir_mib, proc_mem

    args = ["--checkpoint", str(ckpt), "--model-name", "bench-llama", "--kv-tokens", "1024", "--max-seqs", "4"]
    engines = []
    try:
        node = ["--node-cache-dir", str(cache)] if cache else []
        manifest: dict[str, Any] = {}
        for i in range(n):  # one after another: the first publishes the node's copy, the next ones map it
            if i and load == "plan":
                engines.append(start_engine([*args, "--empty", *node]))
                by_plan(engines[0], engines[-1], manifest)
                continue
            engines.append(start_engine([*args, *node]))
            if not manifest:
                manifest = httpx.get(engines[0].url + "/kascade/v1/manifest", timeout=60,
                                     headers={"Authorization": f"Bearer {engines[0].token}"}).json()
        texts = set()
        for e in engines:
            r = httpx.post(e.url + "/v1/completions", json={"model": "bench-llama", "prompt": [5, 6, 7],
                                                             "max_tokens": 4}, timeout=120)
            r.raise_for_status()
            texts.add(r.json()["choices"][0]["text"])
        per = [proc_mem(e.proc.pid) for e in engines]
    finally:
        for e in engines:
            e.stop()
    cache_mib = dir_mib(cache) if cache else 0.0
    return {"engines": n, "same_answer": len(texts) == 1, "per_engine_mib": per, "cache_mib": cache_mib,
            "rss_anon_sum": sum(p["RssAnon"] for p in per), "rss_shmem_sum": sum(p["RssShmem"] for p in per),
            "pss_sum": sum(p["Pss"] for p in per),
            "node_mib": sum(p["RssAnon"] for p in per) + cache_mib}


def baseline(ckpt: Path) -> float:
    from conftest import start_engine

    from kascade_devcluster.procmem import proc_mem

    e = start_engine(["--checkpoint", str(ckpt), "--model-name", "bench-llama", "--empty", "--kv-tokens", "1024",
                      "--max-seqs", "4"])
    try:
        return proc_mem(e.proc.pid)["RssAnon"]
    finally:
        e.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--load", choices=("source", "plan"), default="source",
                    help="how engines after the first get their weights: the checkpoint, or a load plan from the first")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/nodecache[-plan].json")
    args = ap.parse_args()
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_engine.weights.checkpoint import tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kascade-nodecache-"))
    try:
        ckpt = tiny_llama(work / "ckpt", layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        model_mib = pack_checkpoint(ckpt, "bench-llama").total_bytes / (1 << 20)
        base = baseline(ckpt)
        print(f"load: {args.load}; model: {model_mib:.0f} MiB of weights; an engine without weights (--empty): "
              f"RssAnon {base:.0f} MiB")
        rows: dict[str, list[dict[str, Any]]] = {"node-cache": [], "private": []}
        for mode in rows:
            for n in args.counts:
                cache = Path(tempfile.mkdtemp(prefix="kascade-nodecache-", dir="/dev/shm")) if mode == "node-cache" \
                    else None
                try:
                    r = run(ckpt, cache, n, args.load)
                finally:
                    if cache is not None:
                        shutil.rmtree(cache, ignore_errors=True)
                r["weights_mib"] = r["node_mib"] - n * base
                r["copies"] = r["weights_mib"] / model_mib
                rows[mode].append(r)
        print(f"\n{'mode':10s} {'N':>2s} {'RssAnon sum':>11s} {'RssShmem sum':>12s} {'Pss sum':>8s} {'cache':>6s} "
              f"{'node':>6s} {'weights':>8s} {'copies':>6s}   (MiB; node = RssAnon sum + cache)")
        for mode, rs in rows.items():
            for r in rs:
                print(f"{mode:10s} {r['engines']:2d} {r['rss_anon_sum']:11.0f} {r['rss_shmem_sum']:12.0f} "
                      f"{r['pss_sum']:8.0f} {r['cache_mib']:6.0f} {r['node_mib']:6.0f} {r['weights_mib']:8.0f} "
                      f"{r['copies']:6.2f}" + ("" if r["same_answer"] else "  (answers differ!)"))
        print()
        ratios: dict[str, float] = {}
        for n in args.counts[1:]:
            line = []
            for mode, rs in rows.items():
                one = next(r for r in rs if r["engines"] == args.counts[0])
                this = next(r for r in rs if r["engines"] == n)
                key = f"{mode}.hostmem_{n}_replicas_over_{args.counts[0]}"
                ratios[key] = this["node_mib"] / one["node_mib"]
                ratios[f"{mode}.weight_copies_{n}_replicas"] = this["copies"]
                line.append(f"{key} {ratios[key]:.2f} (weight copies {this['copies']:.2f})")
            print("   ".join(line))
        out = {"load": args.load, "model_mib": model_mib, "empty_engine_rss_anon_mib": base, "runs": rows,
               "ratios": ratios}
        dest = args.out or RESULTS / ("nodecache.json" if args.load == "source" else "nodecache-plan.json")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {dest}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
