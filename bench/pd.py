"""PD benchmark: colocated vs disaggregated serving on REAL engine processes (a small random Llama on CPU),
the same request trace through the real router, side by side in one run; and the KV transfer rate over a
tbf-limited link between two network namespaces.

Data flow (SLO part): a seeded bursty trace (`trace`: short prompts as a Poisson background for the whole
trace, long prompts as a Poisson burst in the middle; fixed output length) -> for each setup, fresh engine
processes (one core each) + an in-process router (static backends) -> streamed completions (aiohttp) -> per
request TTFT and mean TBT (a failed request misses both) -> attainment against SLOs calibrated once, at
the start, from one request alone on one idle engine (TTFT SLO = `--ttft-x` x its TTFT on the longest
prompt; TBT SLO = `--tbt-x` x its mean TBT), never tuned per setup. Setups, with the same two engines:
  colocated      2 colocated engines, power-of-two-choices
  disaggregated  1 prefill + 1 decode engine: the router picks both, KV moves over TCP (loopback)
  disaggregated_convertible  the same 1 + 1, and the decoder converted during bursts by the operator's code
                 (`pdconvert.converter`: its Scraper and snapshot -> pdscaling.conversion_input -> the pure policy
                 kascade_planner.conversion: prompt tokens/s arriving vs one prefiller's velocity AS THE
                 ENGINES MEASURE IT ONLINE; chunk budget from the TBT SLO and that velocity), applied as the
                 operator does (engine /convert, then the router's convertible flag): a converted decoder
                 prefills its own requests under the chunk cap when it is less loaded than the prefiller.
                 Every decision's velocities are in pd.json (`conversions`, `policy_samples`). The same loop
                 runs in the disaggregated setup without applying anything (`apply=False`): the operator scrapes
                 a service whatever its convertibleDecoders, and its scraping (every 0.25 s, both engines) shares
                 the machine's 2 cores with the engines, so the two setups differ by the conversion alone (run in
                 the convertible setup only, that setup's prefill steps were 3-14 % slower in 5 of 8 clean runs,
                 4-9 % faster in 3)
Emulated accelerator (`--emulate-layer-ms X`, bench/pdemulate.py): every engine of every setup and the
calibration's runs with the engine's --emulate-layer-ms X and --emulate-knee-tokens K and --max-batch-tokens K
(K: the simulator's memory/compute knee, 117 tokens): a step costs at least 8 x X whatever its batch, up to K
tokens, so a decoder has idle compute during a burst (the GPU condition convertible decoders need; on the CPU a
decoder's step grows with its batch) and a prompt token costs 8 x X / K. SLOs and the burst's load are calibrated
on the emulated engine. pd.json's `engines` and the printed summary say the engines were emulated; each setup's
`emulation_floor` says how often the CPU, not the emulation, timed a step. Headline numbers: the real CPU mode.
Link part (needs root + network namespaces): P in namespace h0, D in h1, the link capped with tbf at
`--link-mbit`; long prompts sent to D naming P -> D's `kascade_kv_link_bytes_per_second` (KV bytes from
first frame to kv_done) / the tbf rate = `kv_transfer_over_link_rate`, for each engine `--transport` in
`--link-transports` (default tcp,ucx; `--link-only` runs just this part -> bench/results/pd-link.json).
KV leaves as each layer is computed, so the rate equals the link's only while P computes a layer faster than the link
carries it:
on a loaded machine a fast link measures P's compute instead (50 Mbit: 0.80 idle-ish, 0.29 under load).
Simulator part (`pdscore.sim_side`): the same trace, time-compressed to the simulator's speeds, through kascade_sim
with the same three setups; its conversions come from the same policy function (kascade_sim.pdpolicy).
The client, the router and other work on the machine share its cores with the engines: absolute numbers
move with load; compare the setups of one run. -> bench/results/pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pdreport
from pdconvert import converter, policy_spec, step_times
from pdemulate import LAYERS, Emulation, floor_check, real_cpu, sim_knee_tokens
from pdscore import MODES, Outcome, Request, sim_side, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / d) for d in ("planner", "cli", "operator", "engine", "router", "sim", "bench")]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(REPO / d) for d in ("planner", "cli", "operator", "engine", "sim", "e2e", "router")
    ),
    "KASCADE_ENGINE_TOKEN": "bench-pd-token",
}
MODEL = "pd-llama"


def engine(ckpt: Path, ns: list[str] | None = None, host: str = "127.0.0.1",
           batch: int = 512, transport: str = "tcp", core: int | None = None,
           log: Path | None = None, emu: Emulation | None = None) -> tuple[subprocess.Popen[str], int, int]:
    """An engine process (one torch thread), pinned to `core` when given: the two engines of a setup get a
    core each, as two GPUs would be, so a prefiller's compute does not slow its decoder's steps. `log`: its
    stderr (the engine's log: hand-backs, remote prefills) goes there instead of nowhere. `emu`: an emulated
    accelerator (pdemulate: its flags, its token budget in place of `batch`)."""
    pin = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    verbose = ["-v"] if log is not None else []  # info: each hand-back and remote prefill is a line
    cmd = [
        *(ns or []),
        *pin,
        sys.executable,
        "-m",
        "kascade_cli.main",
        *verbose,
        "engine",
        "serve",
        "--host",
        host,
        "--port",
        "0",
        "--act-port",
        "0",
        "--checkpoint",
        str(ckpt),
        "--model-name",
        MODEL,
        "--kv-tokens",
        "16384",
        "--max-batch-tokens",
        str(emu.knee_tokens if emu else batch),
        "--max-prompt-tokens",
        "500",
        "--transport",
        transport,
        *(emu.engine_args() if emu else []),
    ]
    err = subprocess.DEVNULL if log is None else log.open("w")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
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


SHORT, LONG = (16, 48), (300, 420)  # prompt tokens: background, burst


def trace(duration_s: float, bg_rate: float, burst_at_s: float, burst_s: float, burst_rate: float,
          seed: int) -> list[tuple[float, list[int], bool]]:
    """(arrival s, prompt, in the burst) sorted by arrival: short prompts (16-48 tokens) as a Poisson stream at
    `bg_rate` for `duration_s` (the decode load), plus long prompts (300-420 tokens) as a Poisson stream at
    `burst_rate` from `burst_at_s` for `burst_s` (the prefill burst)."""
    rng = random.Random(seed)
    out: list[tuple[float, list[int], bool]] = []
    for rate, start, span, (lo, hi), burst in ((bg_rate, 0.0, duration_s, SHORT, False),
                                               (burst_rate, burst_at_s, burst_s, LONG, True)):
        t = start + rng.expovariate(rate)
        while t < start + span:
            out.append((t, [rng.randrange(1, 2000) for _ in range(rng.randint(lo, hi))], burst))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda r: r[0])


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


async def run_trace(url: str, reqs: list[Request], max_tokens: int) -> list[Outcome]:
    """Every request sent at its arrival time; a failed one is kept as its error (it misses both SLOs)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.monotonic()

        async def at(when: float, prompt: list[int]) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            try:
                return await one(s, url, prompt, max_tokens)
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
                return f"{type(e).__name__}: {e}"[:200]

        return await asyncio.gather(*(at(w, p) for w, p, _ in reqs))


async def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples if x.name == name)


async def setup(ckpt: Path, mode: str, reqs: list[Request], max_tokens: int, policy: Any = None,
                emu: Emulation | None = None) -> dict[str, Any]:
    from kascade_router.server import Router, static_routes

    procs: list[subprocess.Popen[str]] = []
    try:
        cores = sorted(os.sched_getaffinity(0))
        logs = os.environ.get("KASCADE_BENCH_ENGINE_LOGS")  # a folder for the engines' logs (evidence)
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
        a, ah, aa = engine(ckpt, core=cores[0], log=Path(logs) / f"{mode}-a.log" if logs else None, emu=emu)
        b, bh, ba = engine(ckpt, core=cores[-1], log=Path(logs) / f"{mode}-b.log" if logs else None, emu=emu)
        procs += [a, b]
        if mode == "colocated":
            spec = f"{MODEL}=127.0.0.1:{ah},127.0.0.1:{bh}"
        else:  # the decoder's data port too: a converted decoder is a prefill candidate (for itself here)
            spec = f"{MODEL}=prefill@127.0.0.1:{ah}+127.0.0.1:{aa},decode@127.0.0.1:{bh}+127.0.0.1:{ba}"
        routes = static_routes([spec])
        router = await Router(routes=routes).start()
        stop_at, conversions, samples = asyncio.Event(), [], []
        task = None
        if mode != "colocated":  # the operator's loop in both PD setups (same scraping load); it converts in one
            (dec,) = [x for x in routes.backends[("static", MODEL)].values() if x.role == "decode"]
            task = asyncio.create_task(converter(dec, f"http://127.0.0.1:{bh}", f"http://127.0.0.1:{ah}", policy,
                                                 ENV["KASCADE_ENGINE_TOKEN"], stop_at, conversions, samples,
                                                 apply=mode == "disaggregated_convertible"))
        try:
            t = time.monotonic()  # the trace's time 0 (conversions are logged in monotonic time)
            res = await run_trace(f"http://127.0.0.1:{router.port}", reqs, max_tokens)
            wall = time.monotonic() - t
        finally:
            stop_at.set()
            if task is not None:
                await task
            await router.close()
        remote = await metric(f"http://127.0.0.1:{bh}", "kascade_pd_remote_prefills_total")
        fallbacks = await metric(f"http://127.0.0.1:{bh}", "kascade_pd_local_fallbacks_total")
        steps = {name: await step_times(f"http://127.0.0.1:{port}") for name, port in (("a", ah), ("b", bh))}
        return {"results": res, "wall_s": wall, "remote_prefills": remote, "fallbacks": fallbacks,
                "conversions": conversions, "policy_samples": samples, "steps": steps, "t0": t,
                "decoder_local_prefills": None if mode == "colocated" else  # its requests whose KV P did not send
                sum(not isinstance(x, str) for x in res) - steps["b"].get("remote_prefills", 0),
                "decoder_handbacks": None if mode == "colocated" else steps["b"].get("handbacks", 0),
                "emulation_floor": floor_check(steps, emu) if emu else None}
    finally:
        stop(procs)


async def calibrate(ckpt: Path, max_tokens: int, emu: Emulation | None = None) -> tuple[float, float]:
    """(TTFT s, mean TBT s) of the longest prompt the trace can hold, alone on one idle engine (median of 3), the
    engine emulated as the setups' are (so the SLOs and the burst's load follow the emulated speed)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        p, ph, _ = engine(ckpt, core=sorted(os.sched_getaffinity(0))[0], emu=emu)
        procs.append(p)
        rng = random.Random(5)
        longest = [rng.randrange(1, 2000) for _ in range(LONG[1])]
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
    from kascade_planner.engine_api import PREFILL_HEADER

    url = f"http://127.0.0.1:{http}"
    rates = []
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for _ in range(prompts):
            await one(s, url, [rng.randrange(1, 2000) for _ in range(480)], 2, {PREFILL_HEADER: peer})
            rates.append(await metric(url, "kascade_kv_link_bytes_per_second"))
    remote = await metric(url, "kascade_pd_remote_prefills_total")
    total = await metric(url, "kascade_kv_transfer_bytes_total")
    carried = await metric(url, "kascade_data_port_bytes_total")  # payload bytes as D's transport counted them
    return {"kv_bytes_per_s": statistics.median(rates), "rates": rates, "remote_prefills": remote,
            "kv_bytes": total, "transport_payload_bytes_received": carried, "transfers": prompts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter trace (20 s, the burst 6 s) and 3 link prompts")
    ap.add_argument("--duration", type=float, default=40.0, help="trace length, s (background stream)")
    ap.add_argument("--bg-rate", type=float, default=1.5, help="short prompts per second, the whole trace")
    ap.add_argument("--burst-at", type=float, default=10.0, help="the prefill burst starts at, s")
    ap.add_argument("--burst", type=float, default=4.0, help="the prefill burst lasts, s")
    ap.add_argument("--burst-load", type=float, default=1.2,
                    help="the burst's prompt tokens/s as a multiple of one engine's calibrated prefill velocity (the "
                         "load follows the machine's speed at the time of the run)")
    ap.add_argument(
        "--burst-rate", type=float, help="long prompts per second during the burst (instead of --burst-load)"
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-x", type=float, default=5.0)
    ap.add_argument("--tbt-x", type=float, default=3.0)
    ap.add_argument("--link-mbit", type=int, default=20,
                    help="tbf rate; low enough that the link, not the prefill compute, is the bottleneck")
    ap.add_argument("--link-transports", default="tcp,ucx",
                    help="data-plane transports (engine --transport) the link part measures, comma-separated")
    ap.add_argument("--link-only", action="store_true", help="only the link part (no SLO setups)")
    ap.add_argument("--modes", default=",".join(MODES), help="setups to run (comma-separated)")
    ap.add_argument("--no-link", action="store_true", help="skip the link measurement")
    ap.add_argument("--sim-only", action="store_true",
                    help="only the simulator side, with the calibration of the last run's pd.json (no engines)")
    ap.add_argument("--emulate-layer-ms", type=float, default=0.0,
                    help="emulate an accelerator on every engine of every setup and the calibration's: each layer "
                         "forward takes at least this long, steps of at most --emulate-knee-tokens tokens (bench/"
                         "pdemulate.py; 0: real CPU, the headline mode). The output says the engines were emulated")
    ap.add_argument("--emulate-knee-tokens", type=int,
                    help="with --emulate-layer-ms: tokens a step holds at one layer time (every engine's "
                         "--max-batch-tokens; default: the simulator's memory/compute knee, its step cost over its "
                         "per-token cost)")
    ap.add_argument("--typed-prefill-velocity", action="store_true",
                    help="diagnostic: type the calibrated prefill velocity into the service spec (tokenVelocity."
                         "prefillTokensPerSecond) instead of the engines' measured one, which the operator takes "
                         "from the slowest prompt-length bucket")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    emu = None
    if args.emulate_layer_ms:
        try:
            emu = Emulation(args.emulate_layer_ms, args.emulate_knee_tokens or sim_knee_tokens())
        except ValueError as e:
            ap.error(str(e))
    elif args.emulate_knee_tokens is not None:
        ap.error("--emulate-knee-tokens needs --emulate-layer-ms")
    if emu and (args.sim_only or args.link_only):
        ap.error("--emulate-layer-ms applies to the SLO setups: not with --sim-only or --link-only")
    transports = [t for t in args.link_transports.split(",") if t]
    bad = [t for t in transports if t not in ("tcp", "ucx")]
    if bad or not transports:
        ap.error(f"--link-transports {args.link_transports!r}: unknown transport {bad[0] if bad else ''!r}; "
                 "use tcp and/or ucx")
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad} (choose from {', '.join(MODES)})")
    duration, burst_at, burst = (20.0, 5.0, 6.0) if args.quick else (args.duration, args.burst_at, args.burst)
    if args.sim_only:
        path = args.out / "pd.json"
        out = json.loads(path.read_text())
        tr = out["trace"]
        reqs = trace(tr["duration_s"], tr["background_rate_per_s"], tr["burst_at_s"], tr["burst_s"],
                     tr["burst_rate_per_s"], seed=tr["seed"])
        out["sim"] = sim_side(
            reqs, out["max_tokens"], out["calibration"]["ttft_ms"] / 1e3, args.ttft_x, args.tbt_x, LONG[1]
        )
        path.write_text(json.dumps(out, indent=2))
        pdreport.report(out, modes, len(reqs))
        print(f"wrote {path}, {pdreport.plot(out, modes, args.out / 'pd.png')}")
        return
    from kascade_engine.weights.checkpoint import tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp) / MODEL, layers=LAYERS, hidden=512, vocab=2048, kv_heads=4)
        if args.link_only:
            lo: dict[str, Any] = {"model": "random Llama 8 layers, hidden 512, 4 KV heads (fp32, CPU)"}
            links(lo, ckpt, args.link_mbit, 3 if args.quick else 5, transports)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "pd-link.json").write_text(json.dumps(lo, indent=2))
            print(f"wrote {args.out / 'pd-link.json'}")
            return
        if emu:
            print(f"ENGINES EMULATED: {emu.describe()['compute']}", flush=True)
        ttft0, tbt0 = asyncio.run(calibrate(ckpt, args.max_tokens, emu))
        # one prefiller's velocity (the conversion policy's input, and the burst's yardstick): the longest
        # prompt alone, from the calibration
        velocity = LONG[1] / ttft0
        burst_rate = args.burst_rate or args.burst_load * velocity / statistics.fmean(LONG)
        reqs = trace(duration, args.bg_rate, burst_at, burst, burst_rate, seed=1)
        ttft_slo, tbt_slo = args.ttft_x * ttft0, args.tbt_x * tbt0
        slo_note = (f"SLOs from one request alone on one idle engine (the longest prompt): TTFT {ttft0 * 1e3:.1f} ms "
                    f"x {args.ttft_x:g} = {ttft_slo * 1e3:.0f} ms, mean TBT {tbt0 * 1e3:.1f} ms x {args.tbt_x:g} = "
                    f"{tbt_slo * 1e3:.0f} ms (set before any setup ran)")
        print(slo_note, flush=True)
        out: dict[str, Any] = {
            "model": "random Llama 8 layers, hidden 512, 4 KV heads (fp32, CPU)"
            + (f", EMULATED accelerator ({emu.layer_ms:g} ms per layer, {emu.knee_tokens}-token steps)" if emu else ""),
            "engines": emu.describe() if emu else real_cpu(),
            "trace": {
                "duration_s": duration,
                "background_rate_per_s": args.bg_rate,
                "background_prompt_tokens": SHORT,
                "burst_at_s": burst_at,
                "burst_s": burst,
                "burst_rate_per_s": burst_rate,
                "burst_load": None if args.burst_rate else args.burst_load,
                "burst_prompt_tokens": LONG,
                "requests": len(reqs),
                "burst_requests": sum(q[2] for q in reqs),
                "seed": 1,
            },
            "max_tokens": args.max_tokens,
            "engines_per_setup": 2,
            "ttft_slo_ms": ttft_slo * 1e3,
            "tbt_slo_ms": tbt_slo * 1e3,
            "slo_note": slo_note,
            "calibration": {"ttft_ms": ttft0 * 1e3, "tbt_ms": tbt0 * 1e3},
        }
        # the calibration's velocity sizes the burst only; the convertible setup's policy reads the velocities
        # the engines measure online (policy_spec types none), recorded per decision in its `conversions`
        out["calibrated_prefill_velocity_tokens_per_s"] = velocity
        out["policy_velocities"] = (
            "measured online by the engines (kascade_*_velocity_tokens_per_second via the operator's Scraper)"
        )
        if args.typed_prefill_velocity:
            out["policy_velocities"] = (
                f"prefill TYPED in the spec: the calibrated {velocity:.0f} tok/s (--typed-prefill-"
                "velocity, a diagnostic); network and decode measured online by the engines"
            )
            print(out["policy_velocities"], flush=True)
        spec = policy_spec(MODEL, tbt_slo, ttft_slo, velocity if args.typed_prefill_velocity else None)
        for mode in modes:
            r = asyncio.run(setup(ckpt, mode, reqs, args.max_tokens, spec, emu))
            out[mode] = summarize(r, reqs, ttft_slo, tbt_slo)
            print(mode, json.dumps({k: v for k, v in out[mode].items() if k != "policy_samples"}), flush=True)
        out["sim"] = sim_side(reqs, args.max_tokens, ttft0, args.ttft_x, args.tbt_x, LONG[1])
        if args.no_link:
            out["link"], out["kv_transfer_over_link_rate"], out["link_note"] = None, None, "not measured: --no-link"
        else:
            links(out, ckpt, args.link_mbit, 3 if args.quick else 5, transports)
            if emu:  # the link part measures the link: its engines compute at the CPU's pace
                out["link_engines"] = "real CPU (not emulated)"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pd.json").write_text(json.dumps(out, indent=2))
    pdreport.report(out, modes, len(reqs))
    print(f"kv_transfer_over_link_rate: {out['kv_transfer_over_link_rate']} "
          f"(tbf {args.link_mbit} Mbit/s between two namespaces)" if out["link"] else out.get("link_note"))
    print(f"wrote {args.out / 'pd.json'}, {pdreport.plot(out, modes, args.out / 'pd.png')}")


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
