"""Reproduce the ~10 s PD stalls: real D and P engine processes (P optionally on an emulated accelerator), the
router in this process, N requests through it (first a concurrent wave on fresh engines, then sequential ones).
Counts requests slower than STALL_S; engine logs (-v, timestamps) go to --logs.

    flock /work/bench.lock python docs/worklog/2026-11-27-f/measurements/stall_repro.py --emulate 20 --wave 7 --seq 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kascade_engine.checkpoint import tiny_llama
from kascade_router.server import Router, static_routes

TOKEN = "stall-token"
STALL_S = 5.0


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[str], int, int]:
    env = {**os.environ, "KASCADE_ENGINE_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "kascade_cli.main", "-v", "engine", "serve", "--port", "0", "--act-port", "0", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
    assert p.stdout is not None
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited {p.wait()}, see {log}")
        if line.startswith("KASCADE_ENGINE_READY"):
            parts = dict(x.split("=") for x in line.split()[1:])
            return p, int(parts["http"]), int(parts["act"])


async def run(a: argparse.Namespace) -> int:
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_llama(Path(tempfile.mkdtemp()) / "tiny", layers=a.layers, hidden=64, vocab=512)
    base = ["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "8192", "--max-batch-tokens", "64"]
    emu = ["--emulate-layer-ms", str(a.emulate), "--emulate-knee-tokens", "64"] if a.emulate else []
    procs = []
    try:
        d = start(base + (emu if a.emulate_d else []), logs / "d.log")
        procs.append(d[0])
        p = start(base + emu, logs / "p.log")
        procs.append(p[0])
        routes = static_routes([f"tiny-llama=decode@127.0.0.1:{d[1]}+127.0.0.1:{d[2]},"
                                f"prefill@127.0.0.1:{p[1]}+127.0.0.1:{p[2]}"])
        router = await Router(routes=routes).start()
        url = f"http://127.0.0.1:{router.port}/v1/completions"
        times: list[tuple[str, float, str | None]] = []
        t00 = time.time()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def one(i: int, n: int, tag: str) -> None:
                body = {"model": "tiny-llama", "prompt": [(7 * j + i) % 500 + 1 for j in range(n)],
                        "max_tokens": a.max_tokens, "temperature": 0}
                t0 = time.monotonic()
                t0w = time.time()
                async with s.post(url, json=body) as r:
                    await r.read()
                    by = r.headers.get("X-Kascade-Prefilled-By")
                    assert r.status == 200, r.status
                dt = time.monotonic() - t0
                times.append((tag, dt, by))
                print(f"{tag} start+{t0w - t00:7.3f}s took {dt:6.3f}s prefilled_by={by}", flush=True)

            await asyncio.gather(*(one(i, a.prompt, f"wave{i}") for i in range(a.wave)))
            for i in range(a.seq):
                await one(100 + i, a.prompt, f"seq{i}")
        await router.close()
        stalls = [t for t in times if t[1] > STALL_S]
        print(f"RESULT emulate={a.emulate} wave={a.wave} seq={a.seq}: {len(stalls)}/{len(times)} over {STALL_S}s; "
              f"max {max(t[1] for t in times):.2f}s", flush=True)
        return len(stalls)
    finally:
        for pr in procs:
            pr.terminate()
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate", type=float, default=20.0, help="P's --emulate-layer-ms (0: none)")
    ap.add_argument("--emulate-d", action="store_true", help="D emulated too")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--wave", type=int, default=7)
    ap.add_argument("--seq", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--logs", default="/tmp/stall_logs")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        filename=str(Path(a.logs) / "router.log") if Path(a.logs).exists() else None)
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
