"""What a converted decoder's decline on arrival costs when it prefills for ANOTHER decoder (rt, 2026-11-27-f).

Real engine processes (tiny random Llama, CPU): D1 decodes; D2 is converted (budget 0.001 ms) beside four long
streams (8 ms emulated layers), so it declines every prompt (rate 0 or not measured); P prefills (not slowed).
Through a real router, alternating: "direct" (D2 not convertible in the router's table: D1 gets P at once) and
"declined" (D2 convertible and cheaper by the table: D1 -> D2 declines -> D1 -> P). Prints client TTFTs.
Run: PYTHONPATH=... flock /work/bench.lock python docs/worklog/2026-11-27-f/measurements/decline_hop.py"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kascade_devcluster.localengine import start_engine
from kascade_engine.checkpoint import tiny_llama
from kascade_planner.engine_api import ConvertRequest
from kascade_router.server import Router, static_routes

TOKEN = "decline-hop"
PROMPT = [(7 * j) % 500 + 1 for j in range(40)]


async def _declined(s: aiohttp.ClientSession, port: int) -> float:
    text = await (await s.get(f"http://127.0.0.1:{port}/metrics")).text()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("kascade_pd_handbacks_total"))


async def main(reps: int) -> None:
    ckpt = tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama", layers=4, hidden=64, vocab=512)
    procs = {n: start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "8192",
                              "--max-batch-tokens", "64", *x], TOKEN)
             for n, x in (("d1", []), ("d2", ["--emulate-layer-ms", "8"]), ("p", []))}
    try:
        d1, d2, p = procs["d1"], procs["d2"], procs["p"]
        routes = static_routes([f"tiny-llama=decode@127.0.0.1:{d1.http}+127.0.0.1:{d1.act},"
                                f"decode@127.0.0.1:{d2.http}+127.0.0.1:{d2.act},"
                                f"prefill@127.0.0.1:{p.http}+127.0.0.1:{p.act}"])
        (backends,) = routes.backends.values()
        b_d1, b_d2, b_p = (backends[f"tiny-llama-{i}"] for i in range(3))
        router = await Router(routes=routes).start()
        out: dict[str, list[float]] = {"direct": [], "declined": []}
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 480, "temperature": 0, "stream": True}
            streams = [await s.post(f"http://127.0.0.1:{d2.http}/v1/completions", json={**body, "prompt": [7 + i, 8, 9]})
                       for i in range(4)]
            await asyncio.sleep(1.0)
            conv = ConvertRequest(16, 0.001, hand_back_ms=100.0).to_dict()
            async with s.post(f"http://127.0.0.1:{d2.http}/kascade/v1/convert", json=conv,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200, await r.text()
            for i in range(2 * reps):
                mode = ("direct", "declined")[i % 2]
                b_d2.convertible = mode == "declined"
                # P counted far busier than D2 even at D2's measured share (0.01 once its rate 0 is known): D2 wins
                b_d2.in_flight, b_p.in_flight = 50, 1000
                before = await _declined(s, d2.http)
                rate = (b_d2.prefill_rate, b_p.prefill_rate)
                t0 = time.perf_counter()
                async with s.post(f"http://127.0.0.1:{router.port}/v1/completions",
                                  json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                        "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            ttft = time.perf_counter() - t0
                            break
                    by = r.headers.get("X-Kascade-Prefilled-By")
                    await r.read()
                out[mode].append(ttft)
                n = await _declined(s, d2.http) - before
                assert n == (mode == "declined"), (mode, n)
                print(f"{mode:9s} ttft {ttft * 1e3:7.1f} ms prefilled by {by}, D2 declined {n:.0f} "
                      f"(router's rates d2, p: {rate})")
                await asyncio.sleep(0.1)
            for r in streams:
                r.close()
        await router.close()
        summary = {m: {"median_ms": round(statistics.median(v) * 1e3, 1), "min_ms": round(min(v) * 1e3, 1),
                       "max_ms": round(max(v) * 1e3, 1), "n": len(v)} for m, v in out.items()}
        print(json.dumps(summary))
        _ = b_d1
    finally:
        for e in procs.values():
            e.stop()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
