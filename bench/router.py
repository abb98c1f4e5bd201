"""Router benchmark: what the front door costs, measured side by side in one run.

Data flow: two engine STUB processes (the engine's OpenAI wire format, no model: here the router is what is
measured) and one `kascade router` process routing a model to each -> one aiohttp client (uvloop, like the
router and the stubs) -> per request: time to first chunk (TTFT) and to the end of the stream, direct to
the stub and through the router, interleaved rounds -> added latency = router percentile - direct
percentile (p50, p99).
- One stream at a time (`serial_*`): the hop's own cost with nothing queued in front.
- `concurrency` (200) streams open at once: OPEN LOOP, Poisson arrivals at concurrency / stream duration,
  the same arrival times for both modes, each stream `--tokens` chunks `--interval` apart (an engine's
  time per output token); the measured mean number of open streams is printed (Little's law). The CPU
  each process used per stream is printed too: the client and the stub are the backend alone.
- Why not only the closed loop (the first version): 200 workers streaming equal-length completions back to
  back stay in step, so requests arrive in bursts; a one-process router handles a burst one request
  after another, so the median waits behind ~100 others (85 / 116 ms added p50 / p99 measured
  that way, against 1.2 ms one stream at a time). `--closed-loop` still prints that case.
- What the open loop showed (shared box, load average 9 -> 5.6): the router costs
  ~2.3 ms of CPU per 32-chunk stream (~70 us per relayed chunk; the client 1.4 ms, the stub 1.7 ms), so
  at 200 streams/s it needs about half a core; when it does not get it, its queue grows (365 streams
  open through the router vs 225 direct) and TTFT with it: the targets were NOT met there. The
  per-chunk relay cost in one Python process is the limit to work on (or more router replicas).
`router_rps_one_core`: non-streaming tiny requests at concurrency 32 through the router, divided by the
CPU seconds the router process used (/proc/<pid>/stat): what one core sustains.
`scale_from_zero_first_token_s`: a router (in this process) knows the model but no replica; a request
arrives and is held; a minimal scaler polling the router's demand (as the operator does, every 0.2 s)
sees it queued, starts a REAL engine process that loads a tiny random Llama from its checkpoint (the
model source: no host cache tier yet) and adds it to the table when it reports ready -> the first
token reaches the client. -> bench/results/router.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(REPO / d) for d in ("planner", "cli", "operator", "engine", "sim", "e2e", "router")
    ),
}


def spawn(argv: list[str], ready: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=env or ENV)
    assert p.stdout is not None
    for line in p.stdout:
        m = re.search(ready + r" http=(\d+)", line)
        if m:
            return p, int(m.group(1))
    raise RuntimeError(f"{argv} exited with {p.wait()}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def streams(url: str, concurrency: int, per_worker: int, model: str = "m") -> tuple[list[float], list[float]]:
    """Closed loop: `concurrency` workers, each streaming `per_worker` completions back to back: (TTFT, total)
    in s. With equal stream lengths the workers stay in step, so requests arrive in bursts of `concurrency`
    at once: used here one stream at a time (the hop's own cost) and for `--closed-loop` (the burst case)."""
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}).encode()
    ttft: list[float] = []
    total: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            for _ in range(per_worker):
                t, tot = await one_stream(s, url, body)
                ttft.append(t)
                total.append(tot)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttft, total


async def one_stream(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        first = None
        async for _chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        return first or 0.0, time.perf_counter() - t0


async def open_loop(url: str, rate: float, n: int, seed: int, skip_s: float,
                    model: str = "m") -> tuple[list[float], list[float], float, int]:
    """Poisson arrivals at `rate` per second (the same `seed` -> the same arrival times for both modes), each
    one stream: (TTFT, total) of the requests that arrived after `skip_s` (the ramp to full concurrency), the
    mean number of streams open (Little's law: total stream-seconds / elapsed) and how many failed."""
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}).encode()
    rng = random.Random(seed)
    out: list[tuple[float, float, float]] = []
    failed = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(at: float) -> None:
            nonlocal failed
            try:
                t, tot = await one_stream(s, url, body)
            except (aiohttp.ClientError, OSError, AssertionError) as e:  # counted, never hidden
                failed += 1
                log_failure(e)
                return
            out.append((at, t, tot))

        tasks = []
        start = time.perf_counter()
        at = 0.0
        for _ in range(n):
            at += rng.expovariate(rate)
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(at)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    kept = [(t, tot) for a, t, tot in out if a >= skip_s]
    return [t for t, _ in kept], [tot for _, tot in kept], sum(tot for _, _, tot in out) / elapsed, failed


def log_failure(e: BaseException) -> None:
    print(f"stream failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


async def rps(url: str, concurrency: int, seconds: float) -> int:
    body = json.dumps({"model": "m", "prompt": [1], "max_tokens": 1}).encode()
    done = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    done += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def scale_from_zero(tmp: Path) -> float:
    from kascade_engine.weights.checkpoint import tiny_llama
    from kascade_router.backends import Routes
    from kascade_router.server import Router
    from kascade_router.settings import RouterSettings

    ckpt = tiny_llama(tmp / "tiny", layers=4, hidden=64, vocab=512)
    routes = Routes()
    routes.set_service("bench", "svc", "tiny")
    router = await Router(RouterSettings(hold_timeout_s=120), routes).start()
    engine: subprocess.Popen[str] | None = None
    try:
        async def scaler() -> None:  # what the operator does, reduced to this one decision
            nonlocal engine
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.get(f"http://127.0.0.1:{router.port}/router/v1/demand") as r:
                        if (await r.json())["models"].get("bench/svc", {}).get("queued"):
                            break
                    await asyncio.sleep(0.2)
            engine, port = await asyncio.to_thread(
                spawn, ["-m", "kascade_cli.main", "engine", "serve", "--checkpoint", str(ckpt), "--model-name", "tiny",
                        "--port", "0"], "KASCADE_ENGINE_READY", {**ENV, "KASCADE_ENGINE_TOKEN": "bench"})
            routes.set_pod({"metadata": {"namespace": "bench", "name": "engine-0",
                                         "labels": {"kascade.io/model-service": "svc"},
                                         "annotations": {"kascade.io/endpoint": f"127.0.0.1:{port}",
                                                         "kascade.io/loaded": "true"}},
                            "status": {"conditions": [{"type": "Ready", "status": "True"}]}})

        task = asyncio.create_task(scaler())
        t0 = time.perf_counter()
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{router.port}/v1/completions",
                json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}) as r:
            assert r.status == 200, await r.text()
            await r.content.readuntil(b"\n\n")
            first = time.perf_counter() - t0
            await r.read()
        await task
        return first
    finally:
        await router.close()
        if engine is not None:
            engine.terminate()
            engine.wait(10)


def run(coro: Any) -> Any:
    """The client's event loop: uvloop when installed, like the router's and the stub's (same client both modes)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class Cpu:
    """CPU seconds used by the client (this process), the stub and the router between two reads."""

    def __init__(self, stub: int, router: int) -> None:
        self.pids = {"stub": stub, "router": router}
        self.t0 = self._now()

    def _now(self) -> dict[str, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"client": ru.ru_utime + ru.ru_stime, **{k: cpu_seconds(p) for k, p in self.pids.items()}}

    def used(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.t0[k] for k in now}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer arrivals (about a minute)")
    ap.add_argument("--concurrency", type=int, default=200, help="streams open at once (open loop: Poisson "
                    "arrivals at concurrency / stream duration)")
    ap.add_argument("--tokens", type=int, default=32, help="chunks per stream in the concurrent phase")
    ap.add_argument("--interval", type=float, default=0.03, help="seconds between chunks (an engine's time per "
                    "output token) in the concurrent phase")
    ap.add_argument("--closed-loop", action="store_true", help="also the old closed loop: `concurrency` workers "
                    "streaming short completions back to back (they arrive in bursts: see the module docstring)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    short, short_port = spawn(["-m", "kascade_devcluster.stubengine", "--tokens", "8", "--delay", "0.005"],
                              "KASCADE_STUB_READY")
    long_, long_port = spawn(["-m", "kascade_devcluster.stubengine", "--tokens", str(args.tokens), "--delay",
                              str(args.interval)], "KASCADE_STUB_READY")
    router, rport = spawn(["-m", "kascade_cli.main", "router", "--host", "127.0.0.1", "--port", "0", "--backend",
                           f"m=127.0.0.1:{short_port}", "--backend", f"long=127.0.0.1:{long_port}"],
                          "KASCADE_ROUTER_READY")
    out: dict[str, Any] = {
        "engine": f"stub (OpenAI SSE wire format, no model): the router is what is measured; concurrent phase: "
                  f"{args.tokens} chunks {1000 * args.interval:g} ms apart per stream; serial phase and rps: 8 "
                  f"chunks 5 ms apart",
        "concurrency": args.concurrency, "quick": args.quick}
    try:
        # one stream at a time, interleaved: the hop's own cost with nothing queued in front
        urls = {"direct": f"http://127.0.0.1:{short_port}/v1/completions",
                "router": f"http://127.0.0.1:{rport}/v1/completions"}
        run(streams(urls["router"], 20, 2, "m"))  # warm up both paths
        run(streams(urls["direct"], 20, 2, "m"))
        serial: dict[str, list[float]] = {"direct": [], "router": []}
        for i in range(6 if args.quick else 10):
            mode = ("direct", "router")[i % 2]
            serial[mode] += run(streams(urls[mode], 1, 40, "m"))[0]
        out |= {"serial_direct_ttft_p50_ms": 1000 * pct(serial["direct"], .5),
                "serial_added_latency_p50_ms": 1000 * (pct(serial["router"], .5) - pct(serial["direct"], .5)),
                "serial_added_latency_p99_ms": 1000 * (pct(serial["router"], .99) - pct(serial["direct"], .99))}
        print(f"one stream at a time: direct TTFT p50 {out['serial_direct_ttft_p50_ms']:.2f} ms, router adds "
              f"p50 {out['serial_added_latency_p50_ms']:.2f} ms, p99 {out['serial_added_latency_p99_ms']:.2f} ms",
              flush=True)

        # `concurrency` streams open at once: Poisson arrivals (no bursts), the same arrival times both modes
        lurls = {"direct": f"http://127.0.0.1:{long_port}/v1/completions",
                 "router": f"http://127.0.0.1:{rport}/v1/completions"}
        duration = statistics.median(run(streams(lurls["direct"], 1, 3, "long"))[1])
        rate = args.concurrency / duration
        seconds, rounds = (3.0, 2) if args.quick else (6.0, 4)
        n = int(rate * (seconds + duration))
        res = {m: {"ttft": [], "total": [], "open": [], "cpu": [], "failed": []} for m in lurls}  # type: ignore[var-annotated]
        print(f"concurrent: stream {1000 * duration:.0f} ms -> {rate:.0f} arrivals/s, {n} per round "
              f"(the first {duration:.1f} s of each round, the ramp, not counted)", flush=True)
        for i in range(rounds):  # interleaved: a load spike from other processes hits both sides
            for mode in ("direct", "router")[:: 1 if i % 2 == 0 else -1]:
                cpu = Cpu(long_.pid, router.pid)
                t, tot, open_, failed = run(open_loop(lurls[mode], rate, n, seed=i, skip_s=duration, model="long"))
                used = cpu.used()
                r = res[mode]
                r["ttft"] += t
                r["total"] += tot
                r["open"].append(open_)
                r["failed"].append(failed)
                r["cpu"].append({k: 1000 * v / n for k, v in used.items()})
                print(
                    f"round {i + 1}/{rounds} {mode:6s}: {len(t)} streams ({failed} failed), {open_:.0f} open on "
                    "average, TTFT p50 "
                    f"{1000 * pct(t, 0.5):.2f} ms p99 {1000 * pct(t, 0.99):.2f} ms; CPU ms per stream: "
                    + ", ".join(f"{k} {1000 * v / n:.2f}" for k, v in used.items()),
                    flush=True,
                )
        d, r = res["direct"], res["router"]

        def cpu_per_stream(mode: str) -> dict[str, float]:
            rows = res[mode]["cpu"]
            return {k: statistics.median(x[k] for x in rows) for k in rows[0]}

        out |= {
            "stream_chunks": args.tokens,
            "chunk_interval_ms": 1000 * args.interval,
            "arrival_rate_per_s": rate,
            "mean_open_streams_direct": statistics.mean(d["open"]),
            "mean_open_streams_router": statistics.mean(r["open"]),
            "requests_per_mode": len(d["ttft"]),
            "failed_direct": sum(d["failed"]),
            "failed_router": sum(r["failed"]),
            "direct_ttft_p50_ms": 1000 * pct(d["ttft"], 0.5),
            "router_ttft_p50_ms": 1000 * pct(r["ttft"], 0.5),
            "direct_ttft_p99_ms": 1000 * pct(d["ttft"], 0.99),
            "router_ttft_p99_ms": 1000 * pct(r["ttft"], 0.99),
            "added_latency_p50_ms": 1000 * (pct(r["ttft"], 0.5) - pct(d["ttft"], 0.5)),
            "added_latency_p99_ms": 1000 * (pct(r["ttft"], 0.99) - pct(d["ttft"], 0.99)),
            "added_total_p50_ms": 1000 * (statistics.median(r["total"]) - statistics.median(d["total"])),
            "cpu_ms_per_stream_direct": cpu_per_stream("direct"),
            "cpu_ms_per_stream_router": cpu_per_stream("router"),
        }
        # the backend alone at the same concurrency: if its TTFT is far above one-stream-at-a-time, the client
        # and the stub already queue for CPU, and the router's difference measures contention, not the hop
        out["direct_saturated"] = out["direct_ttft_p50_ms"] > 2 * out["serial_direct_ttft_p50_ms"] + 1.0

        if args.closed_loop:
            cl = {m: run(streams(u, args.concurrency, 3, "m"))[0] for m, u in urls.items()}
            out |= {"closed_loop_direct_ttft_p50_ms": 1000 * pct(cl["direct"], .5),
                    "closed_loop_added_latency_p50_ms": 1000 * (pct(cl["router"], .5) - pct(cl["direct"], .5)),
                    "closed_loop_added_latency_p99_ms": 1000 * (pct(cl["router"], .99) - pct(cl["direct"], .99))}
            print(
                f"closed loop ({args.concurrency} workers back to back, short streams, bursts): direct TTFT p50 "
                f"{out['closed_loop_direct_ttft_p50_ms']:.1f} ms, router adds p50 "
                f"{out['closed_loop_added_latency_p50_ms']:.1f} ms, p99 {out['closed_loop_added_latency_p99_ms']:.1f} "
                "ms",
                flush=True,
            )

        cpu0 = cpu_seconds(router.pid)
        nreq = run(rps(urls["router"], 32, 2.0 if args.quick else 4.0))
        cpu_s = cpu_seconds(router.pid) - cpu0
        out |= {"router_rps_one_core": nreq / cpu_s if cpu_s > 0 else 0.0, "rps_requests": nreq,
                "rps_router_cpu_s": cpu_s}
    finally:
        for p in (router, short, long_):
            p.terminate()
            p.wait(10)
    with tempfile.TemporaryDirectory() as tmp:
        sys.path[:0] = [str(REPO / d) for d in ("planner", "engine", "router", "e2e", "operator")]
        out["scale_from_zero_first_token_s"] = asyncio.run(scale_from_zero(Path(tmp)))
    out["scale_from_zero_note"] = ("router hold + a scaler polling demand every 0.2 s + a real engine process "
                                   "loading a tiny Llama from its checkpoint (no operator, no cluster)")
    out["load_average"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    ok = out["added_latency_p50_ms"] <= 1.0 and out["added_latency_p99_ms"] <= 5.0
    print(f"targets: added p50 <= 1 ms, p99 <= 5 ms at {out['mean_open_streams_router']:.0f} open streams: "
          f"{'met' if ok else 'NOT met'} (load average {out['load_average']:.1f}"
          f"{'; the direct path alone was saturated: contention, not the hop' if out['direct_saturated'] else ''})")


if __name__ == "__main__":
    main()
