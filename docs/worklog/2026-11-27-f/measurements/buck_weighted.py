"""buck (s13): the demand-weighted prefill velocity on a REAL engine (tiny random Llama, CPU; no emulation).

Warm-up: bursts of concurrent short (100-token) and long (480-token) prompts so both buckets get saturated steps
(capacities). Then one window of a mixed demand (mostly short prompts); the operator's own parser, rate tracker and
snapshot give the one-velocity rule (the slowest bucket) and the weighted velocity, and the prefill need of each.
Run: flock /work/bench.lock python docs/worklog/2026-11-27-f/measurements/buck_weighted.py
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kascade_devcluster.localengine import start_engine
from kascade_engine.checkpoint import tiny_llama
from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot


def burst(url: str, n: int, length: int, seed: int) -> None:
    def one(i: int) -> None:
        body = {"model": "m", "prompt": [(seed + 13 * i + j) % 500 + 1 for j in range(length)], "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()

    with ThreadPoolExecutor(n) as ex:
        list(ex.map(one, range(n)))


def main() -> None:
    ckpt = tiny_llama(Path(tempfile.mkdtemp()) / "tiny", layers=4, hidden=64, vocab=512)
    e = start_engine(["--checkpoint", str(ckpt), "--model-name", "m", "--max-prompt-tokens", "500",
                      "--max-batch-tokens", "256", "--kv-tokens", "16384"])
    try:
        for k in range(3):
            burst(e.url, 16, 100, k)
            burst(e.url, 8, 480, k)
        r = RateTracker()
        r.update("e", parse_engine_metrics(httpx.get(e.url + "/metrics").text, time.monotonic()))
        burst(e.url, 16, 100, 7)  # the window's demand: 1600 short-prompt tokens, 480 long
        burst(e.url, 1, 480, 7)
        load = r.update("e", parse_engine_metrics(httpx.get(e.url + "/metrics").text, time.monotonic()))
        snap = snapshot([load], time.monotonic())
        v = load.velocity
        assert v is not None and snap.measured is not None
        d = dict(load.prompt_tokens_per_s_by_bucket)
        total = sum(d.values())
        print("real engine, tiny random Llama (4 layers, hidden 64), CPU, max-batch-tokens 256; no emulation")
        print(f"bucket capacities (tok/s): {dict(v.prefill_buckets)}")
        print(f"window demand (prompt tok/s by bucket): { {b: round(x, 1) for b, x in d.items()} }")
        print(f"one-velocity rule (slowest bucket): {v.prefill_tokens_per_s:.1f} tok/s -> prefill need "
              f"{total / v.prefill_tokens_per_s:.3f}" if v.prefill_tokens_per_s else "no velocity")
        w = snap.measured.prefill_tokens_per_s
        print(f"demand-weighted: {w:.1f} tok/s -> prefill need {total / w:.3f}" if w else "no weighted velocity")
    finally:
        e.stop()


if __name__ == "__main__":
    main()
