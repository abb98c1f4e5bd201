"""A command-line harness for a tensor-parallel instance without HTTP (tests and the tp-vs-tp1 measurement):
greedy tokens for token-id prompts at a given tp, as JSON, with the decode rate.

    python -m kascade_engine.tp.run --checkpoint DIR --tp 2 --prompt 1,2,3 --max-tokens 16

prints {"tp": 2, "tokens": [[...]], "decode_tok_s": ..., "pids": [...]} (pids: the follower ranks, printed
first on their own line with --announce, so a test can kill one mid-generation). tp 1 runs the plain Engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits
from kascade_engine.tp import launch
from kascade_engine.tp.rank import exit_lost
from kascade_engine.weights.blocks import pack_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kascade_engine.tp.run")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompt", action="append", required=True, help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--plane-dir", type=Path, help="load by plan: rank<r>.json plane specs (planes.py), one per "
                   "rank, each received over that rank's own data port")
    p.add_argument("--announce", action="store_true", help="print the follower pids first, then wait for a line")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    blocks = pack_checkpoint(a.checkpoint)  # tp 1, and the config of every tp
    planes = [a.plane_dir / f"rank{r}.json" for r in range(a.tp)] if a.plane_dir else None
    limits = Limits(kv_tokens=a.kv_tokens)
    prompts = [[int(t) for t in s.split(",")] for s in a.prompt]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    ranks: launch.Ranks | None = None
    if a.tp == 1:
        model = LlamaModel(blocks.config)
        for b in blocks.blocks.values():
            model.add_block(b.id, b.tensors())
        engine = Engine(model, limits)
    else:
        ranks = launch.start(blocks.config, a.checkpoint, a.tp, limits, torch.device("cpu"), torch.float32,
                             threads=a.threads, blocks=blocks, planes=planes)
        engine = ranks.engine
    if a.announce:
        print(json.dumps({"pids": ranks.pids if ranks else []}), flush=True)
        sys.stdin.readline()
    try:
        engine.generate_many(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # prefill
        t0 = time.perf_counter()
        out = engine.generate_many(prompts, params)
        dt = time.perf_counter() - t0
    except RuntimeError as e:  # RankLost, or the step's requests failed with it (Engine.step keeps going)
        if ranks is None or ranks.engine.failed is None:
            raise
        print(f"tensor-parallel instance failed: {ranks.engine.failed} ({e})", file=sys.stderr, flush=True)
        exit_lost()  # as the server (launch.exit_on_lost)
    finally:
        if ranks is not None and ranks.engine.failed is None:
            ranks.stop()
    print(json.dumps({"tp": a.tp, "tokens": out, "decode_tok_s": sum(map(len, out)) / dt,
                      "pids": ranks.pids if ranks else [], "load": ranks.load_stats if ranks else []}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
