#!/usr/bin/env python3
"""Scale-up onto a node that keeps the model's copy: load by plan over the network vs bind from the node's copy
(issue 35 item 3), on real engine processes of one model on this host (one "node").

A keeper engine serves the model with `--node-cache-dir` (it publishes the node's copy). Per round two `--empty`
engines on the same node cache scale up side by side: one loads every block by a one-hop load plan from the keeper
(what a target did before: the blocks cross the data plane, loopback here, then the node's copy is mapped), the
other binds with `source: {nodeCopy: true}` (maps the node's copy, digests verified; no plan, no sender). The bench
times bind/load-plan -> serving for each, and counts the bytes the plan moved (the model, per plan target) vs
none. Each answers one greedy completion, compared with the keeper's.

Usage: python bench/nodecopyload.py [--layers 4 --hidden 1024 --vocab 16000] [--rounds 3]
Prints nodecopy_over_plan_load_seconds (median of the rounds).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / d) for d in ("tests/engine", "engine", "cli", "e2e", "planner", "bench")]


def _ready(e: Any, h: dict[str, str]) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = httpx.get(e.url + "/kascade/v1/status", headers=h, timeout=60).json()
        if st["loadError"]:
            raise RuntimeError(st["loadError"])
        if st["ready"] and st.get("nodeCopy"):
            return
        time.sleep(0.02)
    raise RuntimeError("never ready on the node's copy")


def main() -> int:
    import httpx
    from conftest import start_engine  # the tests' real-engine starter
    from nodecache import by_plan

    from kascade_engine.weights.checkpoint import tiny_llama

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kascade-nodecopyload-"))
    cache = Path(tempfile.mkdtemp(prefix="kascade-nodecopyload-", dir="/dev/shm"))
    body = {"model": "bench-llama", "prompt": [5, 6, 7], "max_tokens": 4}
    engines: list[Any] = []
    try:
        ckpt = tiny_llama(work / "ckpt", layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        base = ["--checkpoint", str(ckpt), "--model-name", "bench-llama", "--kv-tokens", "1024", "--max-seqs", "4",
                "--node-cache-dir", str(cache)]
        keeper = start_engine(base)
        engines.append(keeper)
        h = {"Authorization": f"Bearer {keeper.token}"}
        manifest = httpx.get(keeper.url + "/kascade/v1/manifest", headers=h, timeout=60).json()
        model_bytes = sum(int(m["bytes"]) for m in manifest.values())
        want = httpx.post(keeper.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        plan_s, copy_s = [], []
        for _ in range(args.rounds):
            a, b = start_engine([*base, "--empty"]), start_engine([*base, "--empty"])
            engines += [a, b]
            t0 = time.monotonic()
            by_plan(keeper, a, manifest)  # returns once a serves from the node's copy
            plan_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            httpx.post(b.url + "/kascade/v1/bind", headers=h, timeout=120, json={
                "model": "bench-llama", "modelService": "ns/svc", "role": "colocated",
                "source": {"nodeCopy": True}}).raise_for_status()
            _ready(b, h)
            copy_s.append(time.monotonic() - t0)
            for e in (a, b):
                got = httpx.post(e.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                if got != want:
                    raise RuntimeError(f"answers differ: {got!r} != {want!r}")
            for e in (a, b):
                e.stop()
                engines.remove(e)
        print(f"model {model_bytes / 2**20:.0f} MiB; rounds {args.rounds}; same greedy text: yes")
        print(f"{'path':22s} {'seconds (each round)':32s} {'median':>7s} {'bytes sent to it':>16s}")
        print(f"{'load plan (network)':22s} {' '.join(f'{s:.3f}' for s in plan_s):32s} "
              f"{statistics.median(plan_s):7.3f} {model_bytes:16d}")
        print(f"{'bind nodeCopy':22s} {' '.join(f'{s:.3f}' for s in copy_s):32s} "
              f"{statistics.median(copy_s):7.3f} {0:16d}")
        print(f"nodecopy_over_plan_load_seconds {statistics.median(copy_s) / statistics.median(plan_s):.3f}")
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
