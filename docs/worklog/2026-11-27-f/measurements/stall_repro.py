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


def trace_late_bodies() -> dict[str, int]:
    """Count the router's engine answers whose body bytes arrived after the handler began `Answer.read()` (the
    race: before the fix those bytes waited unparsed until the engine closed the connection). Wraps, changes
    nothing."""
    from kascade_router.upstream import Answer

    seen = {"reads": 0, "late": 0}
    orig_read, orig_rx, orig_reset = Answer.read, Answer.data_received, Answer._reset

    def reset(self: Answer) -> None:  # a pooled connection's next answer
        self._stall_reading = self._stall_counted = False  # type: ignore[attr-defined]
        orig_reset(self)

    async def read(self: Answer, timeout: float) -> bytes:
        seen["reads"] += 1
        self._stall_reading = True  # type: ignore[attr-defined]
        return await orig_read(self, timeout)

    def data_received(self: Answer, data: bytes) -> None:
        if getattr(self, "_stall_reading", False) and not getattr(self, "_stall_counted", False):
            seen["late"] += 1
            self._stall_counted = True  # type: ignore[attr-defined]
        orig_rx(self, data)

    Answer.read, Answer.data_received, Answer._reset = read, data_received, reset  # type: ignore[method-assign]
    return seen


async def run(a: argparse.Namespace) -> int:
    seen = trace_late_bodies() if a.trace else None
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_llama(Path(tempfile.mkdtemp()) / "tiny", layers=a.layers, hidden=64, vocab=512)
    base = ["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "8192", "--max-batch-tokens", "64"]
    emu = ["--emulate-layer-ms", str(a.emulate), "--emulate-knee-tokens", "64"] if a.emulate else []
    procs = []
    try:
        d = start(base + (emu if a.emulate_d or a.colocated else []), logs / "d.log")
        procs.append(d[0])
        if a.colocated:  # one engine, no PD: is the stall the router's, whatever the engines do?
            routes = static_routes([f"tiny-llama=127.0.0.1:{d[1]}"])
        else:
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
                        "max_tokens": a.max_tokens, "temperature": 0, "stream": a.stream}
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
        print(f"RESULT colocated={a.colocated} stream={a.stream} emulate={a.emulate} wave={a.wave} seq={a.seq}: {len(stalls)}/{len(times)} over {STALL_S}s; "
              f"max {max(t[1] for t in times):.2f}s", flush=True)
        if seen is not None:
            print(f"TRACE answers read: {seen['reads']}, body arrived after read() began: {seen['late']}", flush=True)
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
    ap.add_argument("--colocated", action="store_true", help="one colocated engine (emulated if --emulate), no PD")
    ap.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    ap.add_argument("--trace", action="store_true", help="count answers whose body came after read() began")
    ap.add_argument("--logs", default="/tmp/stall_logs")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        filename=str(Path(a.logs) / "router.log") if Path(a.logs).exists() else None)
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
