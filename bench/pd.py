"""PD benchmark: colocated vs disaggregated serving on REAL engine processes (a small random Llama on CPU),
the same request trace through the real router, side by side in one run; and the KV transfer rate over a
tbf-limited link between two network namespaces.

Data flow (SLO part): a seeded trace (Poisson arrivals; prompts short or long; fixed output length) ->
for each setup, fresh engine processes + an in-process router (static backends) -> streamed completions
(aiohttp) -> per request TTFT and mean TBT -> attainment against SLOs calibrated once, at the start, from
one request alone on one idle engine (TTFT SLO = `--ttft-x` x its TTFT on the longest prompt; TBT SLO =
`--tbt-x` x its mean TBT). Setups, with the same number of engine processes:
  colocated      2 colocated engines, power-of-two-choices
  disaggregated  1 prefill + 1 decode engine: the router picks both, KV moves over TCP (loopback)
  disaggregated_convertible  the same 1 + 1, and the decoder converted during bursts by the operator's pure
                 policy (kascade_planner.conversion: prompt tokens/s at the decoder vs one prefiller's velocity
                 from the calibration; chunk budget from the TBT SLO), applied by an in-bench loop as the
                 operator does (engine /convert, then the router's convertible flag): a converted decoder
                 prefills its own requests under the chunk cap when it is less loaded than the prefiller
Link part (needs root + network namespaces): P in namespace h0, D in h1, the link capped with tbf at
`--link-mbit`; long prompts sent to D naming P -> D's `kascade_kv_link_bytes_per_second` (KV bytes from
first frame to kv_done) / the tbf rate = `kv_transfer_over_link_rate`, for each engine `--transport` in
`--link-transports` (default tcp,ucx; `--link-only` runs just this part -> bench/results/pd-link.json).
KV leaves as each layer is computed, so the rate equals the link's only while P computes a layer faster than the link carries it:
on a loaded machine a fast link measures P's compute instead (50 Mbit: 0.80 idle-ish, 0.29 under load).
Both engines and the client share this machine's cores: absolute numbers move with load; compare the
setups of one run. -> bench/results/pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / d) for d in ("cli", "operator", "engine", "router", "bench")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("cli", "operator", "engine", "sim", "e2e",
                                                                             "router")),
       "KASCADE_ENGINE_TOKEN": "bench-pd-token"}
MODEL = "pd-llama"


def engine(ckpt: Path, ns: list[str] | None = None, host: str = "127.0.0.1",
           batch: int = 512, transport: str = "tcp") -> tuple[subprocess.Popen[str], int, int]:
    cmd = [*(ns or []), sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--host", host, "--port", "0",
           "--act-port", "0", "--checkpoint", str(ckpt), "--model-name", MODEL, "--kv-tokens", "16384",
           "--max-batch-tokens", str(batch), "--max-prompt-tokens", "500", "--transport", transport]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    assert p.stdout is not None
    for line in p.stdout:
        m = re.search(r"KASCADE_ENGINE_READY http=(\d+) act=(\d+)", line)
        if m:
            return p, int(m.group(1)), int(m.group(2))
    raise RuntimeError(f"engine exited with {p.wait()}")


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def trace(n: int, rate: float, long_frac: float, seed: int) -> list[tuple[float, list[int]]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        length = rng.randint(300, 420) if rng.random() < long_frac else rng.randint(16, 48)
        out.append((t, [rng.randrange(1, 2000) for _ in range(length)]))
    return out


async def one(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
              headers: dict[str, str] | None = None) -> tuple[float, float, int]:
    """(TTFT s, mean TBT s, tokens) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    times: list[float] = []
    async with s.post(f"{url}/v1/completions", json=body, headers=headers or {}) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    if not times:
        raise RuntimeError("no tokens streamed")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return times[0] - t0, statistics.fmean(gaps) if gaps else 0.0, len(times)


async def run_trace(url: str, reqs: list[tuple[float, list[int]]], max_tokens: int) -> list[tuple[float, float, int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()

        async def at(when: float, prompt: list[int]) -> tuple[float, float, int]:
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            return await one(s, url, prompt, max_tokens)

        return await asyncio.gather(*(at(w, p) for w, p in reqs))


async def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples if x.name == name)


async def converter(decoder: Any, url: str, prefill_url: str, velocity: float, tbt_slo: float,
                    stop_at: asyncio.Event, log: list[dict[str, Any]]) -> None:
    """What the operator does for a disaggregated service (kascade_operator.converter), for the static
    router of this bench: every 0.25 s the prompt tokens/s arriving at the decoder (its counter over the
    last second) and the prompts waiting at the prefiller go through the SAME pure policy (kascade_planner.conversion.plan_conversions) with one
    prefiller at `velocity`; a conversion is applied as the operator does it: the engine's /convert with the
    chunk budget, then the router's convertible flag (the pod annotation's effect); taking back in reverse."""
    from kascade_planner.conversion import ConversionInput, DecoderView, plan_conversions

    hdr = {"Authorization": f"Bearer {ENV['KASCADE_ENGINE_TOKEN']}"}
    hist: list[tuple[float, float]] = []
    async with aiohttp.ClientSession() as s:
        while not stop_at.is_set():
            now, tokens = time.monotonic(), await metric(url, "kascade_prompt_tokens_total")
            hist = [h for h in hist if h[0] >= now - 1.0] + [(now, tokens)]
            rate = (tokens - hist[0][1]) / (now - hist[0][0]) if now > hist[0][0] else 0.0
            waiting = await metric(prefill_url, "kascade_num_requests_waiting")
            c = plan_conversions(ConversionInput(rate, 1, velocity, (DecoderView(decoder.pod, decoder.convertible),),
                                                 prefill_queue=waiting, tbt_slo_s=tbt_slo))
            if c.convert:
                async with s.post(f"{url}/kascade/v1/convert", json={"prefillChunkTokens": c.chunk_tokens},
                                  headers=hdr) as r:
                    r.raise_for_status()
                decoder.convertible = True
            elif c.revert:
                decoder.convertible = False
                async with s.post(f"{url}/kascade/v1/convert", json={"prefillChunkTokens": None}, headers=hdr) as r:
                    r.raise_for_status()
            if c.changes:
                log.append({"t": round(now, 2), "reason": c.reason})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_at.wait(), 0.25)


async def setup(ckpt: Path, mode: str, reqs: list[tuple[float, list[int]]], max_tokens: int,
                velocity: float = 0.0, tbt_slo: float = 0.0) -> dict[str, Any]:
    from kascade_router.server import Router, static_routes

    procs: list[subprocess.Popen[str]] = []
    try:
        a, ah, aa = engine(ckpt)
        b, bh, ba = engine(ckpt)
        procs += [a, b]
        if mode == "colocated":
            spec = f"{MODEL}=127.0.0.1:{ah},127.0.0.1:{bh}"
        else:  # the decoder's data port too: a converted decoder is a prefill candidate (for itself here)
            spec = f"{MODEL}=prefill@127.0.0.1:{ah}+127.0.0.1:{aa},decode@127.0.0.1:{bh}+127.0.0.1:{ba}"
        routes = static_routes([spec])
        router = await Router(routes=routes).start()
        stop_at, conversions = asyncio.Event(), []
        task = None
        if mode == "disaggregated_convertible":
            (dec,) = [x for x in routes.backends[("static", MODEL)].values() if x.role == "decode"]
            task = asyncio.create_task(converter(dec, f"http://127.0.0.1:{bh}", f"http://127.0.0.1:{ah}", velocity, tbt_slo, stop_at, conversions))
        try:
            t = time.monotonic()
            res = await run_trace(f"http://127.0.0.1:{router.port}", reqs, max_tokens)
            wall = time.monotonic() - t
        finally:
            stop_at.set()
            if task is not None:
                await task
            await router.close()
        remote = await metric(f"http://127.0.0.1:{bh}", "kascade_pd_remote_prefills_total")
        fallbacks = await metric(f"http://127.0.0.1:{bh}", "kascade_pd_local_fallbacks_total")
        return {"results": res, "wall_s": wall, "remote_prefills": remote, "fallbacks": fallbacks,
                "conversions": conversions}
    finally:
        stop(procs)


async def calibrate(ckpt: Path, reqs: list[tuple[float, list[int]]], max_tokens: int) -> tuple[float, float]:
    procs: list[subprocess.Popen[str]] = []
    try:
        p, ph, _ = engine(ckpt)
        procs.append(p)
        longest = max((pr for _, pr in reqs), key=len)
        async with aiohttp.ClientSession() as s:
            await one(s, f"http://127.0.0.1:{ph}", longest, 4)  # warm-up
            runs = [await one(s, f"http://127.0.0.1:{ph}", longest, max_tokens) for _ in range(3)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    finally:
        stop(procs)


async def link_rate(ckpt: Path, mbit: int, prompts: int, transport: str = "tcp") -> dict[str, Any]:
    from netlab import NetLab

    with NetLab(2, rate_mbit=mbit, prefix="kbpd") as lab:
        procs: list[subprocess.Popen[str]] = []
        try:
            p, _, pa = engine(ckpt, lab.prefix(0), host="0.0.0.0", batch=2048, transport=transport)
            d, dh, _ = engine(ckpt, lab.prefix(1), host="0.0.0.0", batch=2048, transport=transport)
            procs += [p, d]
            client = (f"import asyncio,sys,json; sys.path[:0]={[str(REPO / 'bench')]!r}; import pd; "
                      f"print(json.dumps(asyncio.run(pd.link_client({dh}, '{lab.addr(0)}:{pa}', {prompts}))))")
            out = subprocess.run([*lab.prefix(1), sys.executable, "-c", client], capture_output=True, text=True,
                                 env=ENV, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            stop(procs)
    r["link_mbit"] = mbit
    r["transport"] = transport
    r["kv_transfer_over_link_rate"] = r["kv_bytes_per_s"] * 8 / (mbit * 1e6)
    return r


async def link_client(http: int, peer: str, prompts: int) -> dict[str, Any]:
    """Runs inside D's namespace: long prompts to D naming P; D's measured KV rate per transfer."""
    url = f"http://127.0.0.1:{http}"
    rates = []
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(prompts):
            await one(s, url, [rng.randrange(1, 2000) for _ in range(480)], 2, {"X-Kascade-Prefill": peer})
            rates.append(await metric(url, "kascade_kv_link_bytes_per_second"))
    remote = await metric(url, "kascade_pd_remote_prefills_total")
    total = await metric(url, "kascade_kv_transfer_bytes_total")
    carried = await metric(url, "kascade_data_port_bytes_total")  # payload bytes as D's transport counted them
    return {"kv_bytes_per_s": statistics.median(rates), "rates": rates, "remote_prefills": remote,
            "kv_bytes": total, "transport_payload_bytes_received": carried, "transfers": prompts}


def summarize(r: dict[str, Any], ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    res = r["results"]
    ttft, tbt = [x[0] for x in res], [x[1] for x in res]
    return {"ttft_slo_attainment": sum(t <= ttft_slo for t in ttft) / len(res),
            "tbt_slo_attainment": sum(t <= tbt_slo for t in tbt) / len(res),
            "both_slo_attainment": sum(a <= ttft_slo and b <= tbt_slo for a, b in zip(ttft, tbt, strict=True)) / len(res),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": sorted(ttft)[int(0.9 * len(ttft))],
            "tbt_mean_p50_s": statistics.median(tbt), "tbt_mean_p90_s": sorted(tbt)[int(0.9 * len(tbt))],
            "wall_s": r["wall_s"], "remote_prefills": r["remote_prefills"], "local_fallbacks": r["fallbacks"],
            "conversions": r["conversions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    ap.add_argument("--long-frac", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ttft-x", type=float, default=5.0)
    ap.add_argument("--tbt-x", type=float, default=3.0)
    ap.add_argument("--link-mbit", type=int, default=20,
                    help="tbf rate; low enough that the link, not the prefill compute, is the bottleneck")
    ap.add_argument("--link-transports", default="tcp,ucx",
                    help="data-plane transports (engine --transport) the link part measures, comma-separated")
    ap.add_argument("--link-only", action="store_true", help="only the link part (no SLO setups)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    transports = [t for t in args.link_transports.split(",") if t]
    bad = [t for t in transports if t not in ("tcp", "ucx")]
    if bad or not transports:
        ap.error(f"--link-transports {args.link_transports!r}: unknown transport {bad[0] if bad else ''!r}; "
                 "use tcp and/or ucx")
    n = 20 if args.quick else args.requests
    from kascade_engine.checkpoint import tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp) / MODEL, layers=8, hidden=512, vocab=2048, kv_heads=4)
        if args.link_only:
            out: dict[str, Any] = {"model": "random Llama 8 layers, hidden 512, 4 KV heads (fp32, CPU)"}
            links(out, ckpt, args.link_mbit, 3 if args.quick else 5, transports)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "pd-link.json").write_text(json.dumps(out, indent=2))
            print(f"wrote {args.out / 'pd-link.json'}")
            return
        reqs = trace(n, args.rate, args.long_frac, seed=1)
        ttft0, tbt0 = asyncio.run(calibrate(ckpt, reqs, args.max_tokens))
        ttft_slo, tbt_slo = args.ttft_x * ttft0, args.tbt_x * tbt0
        print(f"calibration (one request alone): TTFT {ttft0 * 1e3:.1f} ms, TBT {tbt0 * 1e3:.1f} ms -> SLOs "
              f"TTFT {ttft_slo * 1e3:.0f} ms, TBT {tbt_slo * 1e3:.0f} ms", flush=True)
        out = {"model": "random Llama 8 layers, hidden 512, 4 KV heads (fp32, CPU)", "requests": n,
               "rate_per_s": args.rate, "long_fraction": args.long_frac, "max_tokens": args.max_tokens,
               "ttft_slo_ms": ttft_slo * 1e3, "tbt_slo_ms": tbt_slo * 1e3,
               "calibration": {"ttft_ms": ttft0 * 1e3, "tbt_ms": tbt0 * 1e3}}
        # one prefiller's velocity for the conversion policy: the longest prompt alone, from the calibration
        velocity = len(max((pr for _, pr in reqs), key=len)) / ttft0
        out["prefill_velocity_tokens_per_s"] = velocity
        for mode in ("colocated", "disaggregated", "disaggregated_convertible"):
            r = asyncio.run(setup(ckpt, mode, reqs, args.max_tokens, velocity, tbt_slo))
            out[mode] = summarize(r, ttft_slo, tbt_slo)
            print(mode, json.dumps(out[mode]), flush=True)
        links(out, ckpt, args.link_mbit, 3 if args.quick else 5, transports)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pd.json").write_text(json.dumps(out, indent=2))
    print("setup                      TTFT SLO att.  TBT SLO att.  TTFT p50 s  mean TBT p50 ms  (SLOs: TTFT "
          f"{ttft_slo:.2f} s, TBT {tbt_slo * 1e3:.0f} ms; real engines, CPU, loaded machine: compare rows)")
    for mode in ("colocated", "disaggregated", "disaggregated_convertible"):
        r = out[mode]
        if r is None:
            print(f"{mode:26} {out[mode + '_note']}")
        else:
            print(f"{mode:26} {r['ttft_slo_attainment']:13.2f} {r['tbt_slo_attainment']:13.2f} "
                  f"{r['ttft_p50_s']:11.2f} {r['tbt_mean_p50_s'] * 1e3:16.0f}")
    print(f"wrote {args.out / 'pd.json'}")


def links(out: dict[str, Any], ckpt: Path, mbit: int, prompts: int, transports: list[str]) -> None:
    """The link part, once per transport: `link` / `kv_transfer_over_link_rate` stay the first transport's
    (tcp by default, as before); every transport's result is in `link_by_transport`."""
    from netlab import available

    why = available() if os.geteuid() == 0 else "needs root"
    out["link"], out["kv_transfer_over_link_rate"], out["link_by_transport"] = None, None, {}
    if why is not None:
        out["link_note"] = f"not measured: network namespaces unavailable ({why})"
        print(out["link_note"])
        return
    for t in transports:
        if t == "ucx" and importlib.util.find_spec("ucxx") is None:
            out["link_by_transport"][t] = None
            out[f"link_note_{t}"] = "not measured: ucxx is not installed"
            print(out[f"link_note_{t}"])
            continue
        r = asyncio.run(link_rate(ckpt, mbit, prompts, t))
        out["link_by_transport"][t] = r
        if out["link"] is None:
            out["link"], out["kv_transfer_over_link_rate"] = r, r["kv_transfer_over_link_rate"]
        print("link", json.dumps(r), flush=True)
        print(f"kv_transfer_over_link_rate[{t}]: {r['kv_transfer_over_link_rate']:.3f} "
              f"(tbf {mbit} Mbit/s between two namespaces)", flush=True)

if __name__ == "__main__":
    main()
