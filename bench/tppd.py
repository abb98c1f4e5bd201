#!/usr/bin/env python3
"""Prefill/decode disaggregation with tensor-parallel instances: time to first token of a prompt prefilled on one
engine and decoded on another, for every pairing of TP-1 and TP-2 engines, measured side by side (rounds alternate
the pairings) in one run.

Engines: real `kascade engine serve` processes on this machine (TP-2: two ranks, gloo); two TP-1 and two TP-2.
A request goes to the decode engine D with the router's `X-Kascade-Prefill` naming the prefill engine P's data port
(streamed, max_tokens 2: the first token's time is P's prefill + the KV gather at P's rank 0 + the wire +
D's checks + the scatter at D's rank 0). Colocated TTFT (no PD) of both widths is printed beside it.
-> `ttft_ms_<P>_to_<D>` (median over rounds) and `<pairing>_over_tp1_to_tp1`; then the gather and the scatter
alone (`kv_gather_ms_tp2`, `kv_scatter_ms_tp2`: a TP-2 instance in this process, its read_kv / write_kv timed). A TTFT
counts more than the KV handling: an adopted prompt's first token is delivered with D's next step (a decode step,
dearer at TP-2 on CPU), and a TP prefill engine ships the KV after its step rather than layer by layer. On a loaded
2-core machine the ranks share the cores: the numbers say what it costs here, not on GPUs (docs/tp.md).
`python bench/tppd.py [--quick]` writes bench/results/tppd.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import report

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.engine_api import PREFILL_HEADER

PROMPT = list(range(3, 3 + 120))


def ttft_ms(d: EngineProc, p: EngineProc | None) -> float:
    """The first streamed token's time. max_tokens 2: a prompt that ends at its first token is never adopted into
    D's cache (nothing to scatter); this one is, before its first token is out."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {PREFILL_HEADER: f"127.0.0.1:{p.act}"} if p is not None else {}
    t0 = time.perf_counter()
    with httpx.stream("POST", d.url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(r.read().decode())
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = (time.perf_counter() - t0) * 1e3
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def kv_ms(ckpt: Path, rounds: int) -> dict[str, float]:
    """The gather and the scatter alone: a TP-2 instance started in this process (rank 0 here), `read_kv` and
    `write_kv` of the prompt's slots timed directly, median ms."""
    import torch

    from kascade_engine.batch.scheduler import Limits
    from kascade_engine.tp.launch import start
    from kascade_engine.weights.blocks import pack_checkpoint

    blocks = pack_checkpoint(ckpt)
    ranks = start(blocks.config, ckpt, 2, Limits(kv_tokens=8192), torch.device("cpu"), torch.float32, blocks=blocks)
    try:
        eng, slots = ranks.engine, torch.arange(16, 16 + len(PROMPT))
        k, v = eng.read_kv(slots)
        out: dict[str, list[float]] = {"gather": [], "scatter": []}
        for _ in range(4 * rounds):
            t0 = time.perf_counter()
            eng.read_kv(slots)
            t1 = time.perf_counter()
            eng.write_kv(slots, k, v)
            out["gather"].append((t1 - t0) * 1e3)
            out["scatter"].append((time.perf_counter() - t1) * 1e3)
        return {f"kv_{name}_ms_tp2": statistics.median(ts) for name, ts in out.items()}
    finally:
        ranks.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    rounds = 3 if ap.parse_args().quick else 9
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp) / "m", layers=8, hidden=256, vocab=2048)
        common = ["--checkpoint", str(ckpt), "--model-name", "m", "--max-prompt-tokens", "256", "--kv-tokens", "8192"]
        kv = kv_ms(ckpt, rounds)
        e: dict[str, EngineProc] = {}
        try:
            for name, tp in (("tp1", 1), ("tp1b", 1), ("tp2", 2), ("tp2b", 2)):
                e[name] = start_engine([*common, "--tp", str(tp)], timeout=300)
            # (prefill engine or None: colocated, decode engine)
            pairings = {"tp1_to_tp1": ("tp1b", "tp1"), "tp2_to_tp1": ("tp2", "tp1"), "tp1_to_tp2": ("tp1", "tp2"),
                        "tp2_to_tp2": ("tp2b", "tp2"), "colocated_tp1": (None, "tp1"), "colocated_tp2": (None, "tp2")}
            times: dict[str, list[float]] = {k: [] for k in pairings}
            for _ in range(rounds + 1):  # the first round warms every engine and connection up, not counted
                for k, (p, d) in pairings.items():
                    times[k].append(ttft_ms(e[d], None if p is None else e[p]))
        finally:
            for x in e.values():
                x.stop()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    out: dict[str, float | str] = {f"ttft_ms_{k}": v for k, v in med.items()}
    for k in ("tp2_to_tp1", "tp1_to_tp2", "tp2_to_tp2"):
        out[f"{k}_over_tp1_to_tp1"] = med[k] / med["tp1_to_tp1"]
    out["colocated_tp2_over_tp1"] = med["colocated_tp2"] / med["colocated_tp1"]
    out.update(kv)
    out["prompt_tokens"] = str(len(PROMPT))
    out["kv_bytes_per_prompt"] = str(len(PROMPT) * 2 * 8 * 2 * 64 * 4)  # fp32 K and V, 8 layers, 2 KV heads of 64
    report("tppd", out, {})


if __name__ == "__main__":
    main()
