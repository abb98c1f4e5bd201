"""Host overhead of the engine's decode step: tiny random Llama, batch 64, fp32, CPU, in process.

On a model this small the arithmetic is next to nothing, so a decode step's wall time is the host's
cost of running it: Python, metadata, torch dispatch, sampling. Printed per engine tree:
  step_cpu_ms        median CPU time (this thread; torch runs 1 thread) of `Engine.step()` over decode-only steps at
                     batch 64 (4 layers): the host's cost, and far less sensitive to other tenants than wall time
  step_ms            median wall time of the same steps
  ops_per_layer      torch ops per layer per decode step (torch.profiler, top-level aten ops):
                     (ops of a 4-layer step - ops of a 2-layer step) / 2, so any engine version is counted alike
  ops_per_step_fixed torch ops per step outside the layers (metadata, embedding, head, sampling)
  decode_tps         generated tokens/s at batch 64 (= 64 / step time)

`--against REF` measures the engine of git REF (exported with `git archive` into /tmp) side by side with
this tree: each tree runs in its own process, rounds alternate, the round with the lowest step_cpu_ms per
tree is kept, and the ratio before/after (of step_cpu_ms) is printed with the load average (2 shared
cores: timings are noisy).

Data flow: tiny_llama checkpoint -> pack_checkpoint -> LlamaModel + Engine(max_seqs 64) -> 64 prompts of
16 tokens, prefilled -> timed decode steps -> profiled decode step at 4 and 2 layers -> one JSON line
per worker -> the parent prints the table and writes bench/results/engine_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WINGS = ("planner", "cli", "operator", "engine", "sim", "e2e", "router")


def _decode_engine(layers: int, batch: int, tmp: Path) -> Any:
    import torch

    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.batch.sampling import SamplingParams
    from kascade_engine.batch.scheduler import Limits
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_engine.weights.checkpoint import tiny_llama

    torch.manual_seed(0)
    blocks = pack_checkpoint(tiny_llama(tmp / f"tiny-{layers}", layers=layers, hidden=64, vocab=512),
                             model="tiny-llama")
    m = LlamaModel(blocks.config)
    e = Engine(m, Limits(max_batch_tokens=2048, max_seqs=batch, kv_tokens=batch * 1024, page_size=16))
    e.load_blocks(blocks.blocks.values())
    for i in range(batch):
        e.submit([(7 * i + j) % 500 + 1 for j in range(16)], SamplingParams(max_tokens=1000, ignore_eos=True))
    while any(r.out == [] for r in e.requests.values()):  # prefill until every sequence decodes
        e.step()
    return e


def _ops(e: Any) -> int:
    """Top-level aten ops in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        e.step()
    return sum(1 for ev in prof.events() if ev.name.startswith("aten::") and
               (ev.cpu_parent is None or not ev.cpu_parent.name.startswith("aten::")))


def worker(steps: int, batch: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="overhead-") as d:
        e4, e2 = _decode_engine(4, batch, Path(d)), _decode_engine(2, batch, Path(d))
        for _ in range(5):
            e4.step()
        times, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            e4.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        o4, o2 = _ops(e4), _ops(e2)
    per_layer = (o4 - o2) / 2
    ms = 1000 * statistics.median(times)
    return {"step_ms": ms, "step_ms_min": 1000 * min(times), "step_cpu_ms": 1000 * statistics.median(cpu),
            "ops_per_layer": per_layer,
            "ops_per_step_fixed": o2 - 2 * per_layer, "decode_tps": batch / (ms / 1000)}


def export(ref: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"overhead-{ref[:12]}-"))
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "engine", "planner"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=data, check=True)
    return out


def run_tree(tree: Path, steps: int, batch: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / w) for w in WINGS if (tree / w).exists()) +
           os.pathsep + os.pathsep.join(str(ROOT / w) for w in WINGS)}
    p = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps), "--batch", str(batch)],
                       env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="git ref whose engine is measured side by side with this tree (before)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.steps, a.batch)))
        return
    trees = {"this": ROOT} if not a.against else {a.against: export(a.against), "this": ROOT}
    load0 = os.getloadavg()
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(a.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_tree(tree, a.steps, a.batch))
    load1 = os.getloadavg()
    best = {k: min(v, key=lambda r: r["step_cpu_ms"]) for k, v in rounds.items()}
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}; batch {a.batch}, fp32, CPU, 1 thread")
    print(f"{'tree':>14} {'cpu_ms':>7} {'cpu_ms rounds':>22} {'wall_ms':>8} {'ops/layer':>10} {'ops/step fixed':>15}")
    for k, r in best.items():
        alls = " ".join(f"{x['step_cpu_ms']:.2f}" for x in rounds[k])
        print(f"{k:>14} {r['step_cpu_ms']:7.2f} {alls:>22} {r['step_ms']:8.2f} {r['ops_per_layer']:10.1f} "
              f"{r['ops_per_step_fixed']:15.1f}")
    result: dict[str, Any] = {"batch": a.batch, "load_before": load0, "load_after": load1, "best": best,
                              "rounds": rounds}
    if a.against:
        b, t = best[a.against], best["this"]
        result["overhead_before_over_after"] = b["step_cpu_ms"] / t["step_cpu_ms"]
        result["ops_before_over_after"] = (4 * b["ops_per_layer"] + b["ops_per_step_fixed"]) / (
            4 * t["ops_per_layer"] + t["ops_per_step_fixed"])
        print(f"step cpu before/after: {result['overhead_before_over_after']:.2f}x; torch ops per step "
              f"before/after: {result['ops_before_over_after']:.2f}x")
    out = ROOT / "bench" / "results" / "engine_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
