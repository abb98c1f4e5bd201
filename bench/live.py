"""Live scaling benchmark: an overloaded engine A (full model) and a loading engine B whose blocks
arrive over a slow link, serving a burst of requests: stop-the-world vs best-effort vs ZigZag.

Data flow: tiny random Llama (offline) -> blocks -> A holds all, B receives block l at
(l+1)·load_ratio·τ (τ = one measured layer computation; the slow link is emulated by these arrival
times) -> a burst arrives at 1.6x A's capacity -> executors A and B run real torch layer
computations, one layer at a time, picking work by the mode's policy (the same rules as
kascade_planner.zigzag). Default clock: one unit per layer computation (deterministic, immune to
other processes on a shared 2-core box; converted to seconds with the measured layer time τ; every
B -> A switch is charged the measured time to ship the activations over the real TCP transport);
`--realtime`: two wall-clock threads instead (noisy here) -> TTFT per request, prefill tokens/s over time ->
bench/results/live.json and
live.png. `split_exact` checks every first token against a single engine, plus a split over the real
TCP transport (B's prefix here, A's suffix behind a TCP listener) against a single engine.
Engine pair section (`engine_pair`, not emulated): two real EngineInstances, B loading with half the
layers paired with A over one TCP connection, B's requests batched per step (cooperation.py):
`split_exact_batched`, `activation_bytes_per_token` beside its theory (hidden x dtype bytes), frames
and connections counted. The policy comparison on real engines with real transfers over tbf-linked
namespaces, and pipelines k=2/4, are the real section (livereal.py, on livelab.py's fleets; `--real-only`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import livereal
import numpy as np
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.kvcache import SequenceKV
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.live.split import Finisher, SplitClient
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.zigzag import PairSetting, ilp_config

MODES = ("stop-the-world", "best-effort", "zigzag", "zigzag-ilp")


@dataclass
class Job:
    i: int
    arrival: float
    ids: torch.Tensor
    hidden: torch.Tensor | None = None
    kv: SequenceKV = field(default_factory=SequenceKV)
    done: int = 0
    on_b: int = 0
    last: str = ""  # executor of the previous layer: a B -> A switch pays the activation transfer
    owner: str = ""
    running: bool = False
    finish: float | None = None
    token: int | None = None


def full_model(bs: BlockSet) -> LlamaModel:
    m = LlamaModel(bs.config)
    for b in bs.blocks.values():
        m.add_block(b.id, b.tensors())
    return m


def layer_time(m: LlamaModel, T: int) -> float:
    h = m.embed(torch.arange(T) % m.shape.vocab)
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        m.run_layers(0, 1, h, SequenceKV(), 0)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def choose(mode: str, ex: str, now: float, jobs: list[Job], b: LlamaModel, prefix: tuple[int, ...]) -> Job | None:
    """The mode's policy (kascade_planner.zigzag rules): which job executor `ex` runs one layer of next."""
    L = b.shape.layers

    def b_loaded(j: Job) -> bool:
        return b.resident(f"layer.{j.done}") if j.done < L else b.complete

    open_ = [j for j in jobs if j.arrival <= now and j.finish is None and not j.running]
    if ex == "A":
        mine = [j for j in open_ if j.owner == "A"]
        if mine:
            return mine[0]
        if mode in ("stop-the-world", "best-effort"):
            return next((j for j in open_ if j.owner == ""), None)
        if mode == "zigzag-ilp":  # suffixes FCFS among jobs whose configured prefix ran on B
            return next((j for j in open_ if j.on_b >= prefix[j.i] or b.complete), None)
        return max(open_, key=lambda j: (j.done, -j.i)) if open_ else None  # zag: closest to done
    if mode == "stop-the-world" and not b.complete:
        return None
    if mode == "best-effort":
        for j in [j for j in open_ if j.owner == "B"]:
            if b_loaded(j):
                return j
            j.owner = ""  # stuck on a layer still in flight: hand it to A
        return next((j for j in open_ if j.owner == "" and j.done == 0 and b_loaded(j)), None)
    if mode == "zigzag-ilp":
        return next((j for j in open_ if j.owner != "A" and (j.on_b < prefix[j.i] or b.complete) and b_loaded(j)), None)
    mine = [j for j in open_ if j.owner == "B" and b_loaded(j)]
    fresh = [j for j in open_ if j.owner != "A" and b_loaded(j)]
    return (mine or fresh or [None])[0]  # zig: FCFS among jobs whose next layer is loaded


def run_virtual(mode: str, bs: BlockSet, a: LlamaModel, prompts: list[torch.Tensor], gap: float, load: float,
                prefix: tuple[int, ...], migrate: float = 0.0) -> list[Job]:
    """Same policies and the same real torch computations, on a clock that advances one unit per layer
    computation (arrivals and block landings on that clock too): immune to other processes on the box."""
    L = a.shape.layers
    b = LlamaModel(bs.config)
    jobs = [Job(i, i * gap, p) for i, p in enumerate(prompts)]
    order = ["embed", *(f"layer.{i}" for i in range(L))]
    nxt, t = 0, 0.0
    busy: dict[str, tuple[Job, float, int | None] | None] = {"A": None, "B": None}
    while any(j.finish is None for j in jobs):
        while nxt < len(order) and nxt * load <= t + 1e-9:
            b.add_block(order[nxt], bs.blocks[order[nxt]].tensors())
            if nxt == len(order) - 1:
                b.add_block("head", bs.blocks["head"].tensors())
            nxt += 1
        for ex, run in busy.items():
            if run is not None and run[1] <= t + 1e-9:
                j, end, tok = run
                j.done, j.on_b, j.running = j.done + 1, j.on_b + (ex == "B"), False
                if tok is not None:
                    j.token, j.finish = tok, end
                busy[ex] = None
        for ex in ("A", "B"):
            if busy[ex] is None:
                j = choose(mode, ex, t, jobs, b, prefix)
                if j is not None:
                    j.running, j.owner = True, ex
                    m = a if ex == "A" else b
                    if j.hidden is None:
                        j.hidden = m.embed(j.ids)
                    j.hidden = m.run_layers(j.done, j.done + 1, j.hidden, j.kv, 0)
                    tok = int(m.logits(j.hidden[-1:])[0].argmax()) if j.done + 1 == L else None
                    busy[ex] = (j, t + 1.0 + (migrate if j.last not in ("", ex) else 0.0), tok)
                    j.last = ex
        events = [r[1] for r in busy.values() if r is not None] + [j.arrival for j in jobs if j.arrival > t + 1e-9]
        if nxt < len(order):
            events.append(nxt * load)
        if not events:
            if any(j.finish is None for j in jobs):
                raise RuntimeError(f"{mode}: no runnable work and no pending event at t={t}")
            break
        t = min(events)
    return jobs


def run_mode(mode: str, bs: BlockSet, a: LlamaModel, prompts: list[torch.Tensor], gap: float, load: float,
             prefix: tuple[int, ...]) -> list[Job]:
    L = a.shape.layers
    b = LlamaModel(bs.config)
    jobs = [Job(i, i * gap, p) for i, p in enumerate(prompts)]
    cond = threading.Condition()
    t0 = time.perf_counter()
    order = ["embed", *(f"layer.{i}" for i in range(L))]

    def loader() -> None:  # the slow link: block l lands at (l+1)·load (embed at once, head with the last layer)
        for k, bid in enumerate(order):
            time.sleep(max(0.0, t0 + k * load - time.perf_counter()))
            with cond:
                b.add_block(bid, bs.blocks[bid].tensors())
                if bid == order[-1]:
                    b.add_block("head", bs.blocks["head"].tensors())
                cond.notify_all()

    def pick(ex: str, now: float) -> Job | None:
        return choose(mode, ex, now, jobs, b, prefix)

    def worker(ex: str) -> None:
        torch.set_num_threads(1)
        m = a if ex == "A" else b
        while True:
            with cond:
                while True:
                    if all(j.finish is not None for j in jobs):
                        return
                    j = pick(ex, time.perf_counter() - t0)
                    if j is not None:
                        j.running, j.owner = True, (ex if mode != "zigzag" or ex == "A" or j.owner != "A" else j.owner)
                        break
                    cond.wait(0.0005)
            if j.hidden is None:
                j.hidden = m.embed(j.ids)
            j.hidden = m.run_layers(j.done, j.done + 1, j.hidden, j.kv, 0)
            tok = int(m.logits(j.hidden[-1:])[0].argmax()) if j.done + 1 == L else None
            with cond:
                j.done += 1
                j.on_b += ex == "B"
                j.running = False
                if tok is not None:
                    j.token, j.finish = tok, time.perf_counter() - t0
                cond.notify_all()

    threads = [threading.Thread(target=f, args=args) for f, args in ((loader, ()), (worker, ("A",)), (worker, ("B",)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return jobs


async def activation_time(a: LlamaModel, tokens: int) -> float:
    """Median time to ship one request's activations [tokens, hidden] over the real TCP transport and
    get the reply frame back (what a B -> A hand-off costs); charged on every switch in the layer clock."""
    from kascade_engine.live.activation import encode_activation

    async def echo(conn) -> None:  # type: ignore[no-untyped-def]
        try:
            while True:
                h, _ = await conn.recv()
                await conn.send({"op": "token", "req": h["req"], "token": 0})
        except Exception:
            return

    listener = await TcpTransport().listen("127.0.0.1", 0, echo)
    conn = await TcpTransport().connect("127.0.0.1", listener.port)
    header, raw = encode_activation("m", 0, 1, torch.zeros(tokens, a.shape.hidden), SamplingParams())
    ts = []
    for _ in range(30):
        t0 = time.perf_counter()
        await conn.send(header, raw)
        await conn.recv(timeout=10)
        ts.append(time.perf_counter() - t0)
    await conn.close()
    await listener.close()
    return statistics.median(ts)


async def split_over_tcp(bs: BlockSet, prompts: list[list[int]], k: int) -> bool:
    a = full_model(bs)
    single = Engine(full_model(bs))
    listener = await TcpTransport().listen("127.0.0.1", 0, Finisher(a).handle)
    conn = await TcpTransport().connect("127.0.0.1", listener.port)
    b = LlamaModel(bs.config)
    for bid in ("embed", *(f"layer.{i}" for i in range(k))):
        b.add_block(bid, bs.blocks[bid].tensors())
    try:
        ok = True
        for n, p in enumerate(prompts):
            params = SamplingParams(max_tokens=6)
            ok &= await SplitClient(b, conn).generate(f"p{n}", p, params, k) == single.generate(p, params)
        return ok
    finally:
        await conn.close()
        await listener.close()


async def engine_pair(bs: BlockSet, prompts: list[list[int]], k: int) -> dict[str, object]:
    """The product path, measured: a loading EngineInstance B (k layers) paired with a full one A over
    one TCP connection (cooperation.py), B's requests batched per step; exactness against the unsplit
    engine, activation bytes per token beside hidden x dtype bytes, frames and connections counted."""
    from kascade_engine.config import EngineConfig
    from kascade_engine.instance import EngineInstance
    from kascade_engine.tokenizer import ByteTokenizer
    from kascade_planner.engine_api import CooperateRequest

    def inst(name: str, resident: int | None) -> EngineInstance:
        cfg = EngineConfig(checkpoint=Path("."), model_name="bench-llama", token="bench", kv_tokens=8192,
                           instance=name, resident_layers=resident)
        i = EngineInstance(cfg, bs.config, ByteTokenizer(), bs)
        i.serving.start()
        return i

    params = SamplingParams(max_tokens=8)
    want = Engine(full_model(bs)).generate_many(prompts, params)
    a, b = inst("a", None), inst("b", k)
    lst = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    try:
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))

        async def one(p: list[int]) -> list[int]:
            return [ev.token async for ev in b.serving.tokens(b.serving.submit(p, params))]

        got = await asyncio.gather(*(one(p) for p in prompts))
        pc = b.pair
        assert pc is not None
        hidden, elt = b.model.shape.hidden, torch.empty(0, dtype=b.model.dtype).element_size()
        return {
            "split_exact_batched": got == want,
            "activation_bytes_per_token": pc.bytes_sent / max(1, pc.tokens_sent),
            "activation_bytes_per_token_theory": hidden * elt,
            "pair_frames": pc.steps_sent,
            "pair_requests": len(prompts),
            "pair_tokens_generated": sum(len(g) for g in got),
            "pair_connections_accepted": a.finisher.connections,
            "pair_split_k": k,
        }
    finally:
        await b.close()
        await a.close()
        await lst.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small burst, < 1 minute")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--load-ratio", type=float, default=16.0, help="loading one layer = this many layer computations")
    ap.add_argument("--overload", type=float, default=1.6, help="arrival rate / A's capacity")
    ap.add_argument("--rounds", type=int, default=None, help="repetitions (median ratio reported)")
    ap.add_argument(
        "--realtime",
        action="store_true",
        help="wall-clock threads for A and B (noisy on a shared box) instead of the layer clock",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument(
        "--no-real",
        action="store_true",
        help="skip the real-engine section (engine processes in tbf-linked namespaces; needs root)",
    )
    livereal.add_args(ap)
    args = ap.parse_args()
    if args.real_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "live_real.json").write_text(json.dumps(livereal.real_section(args), indent=2))
        return
    n = args.requests or (24 if args.quick else 64)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        bs = pack_checkpoint(
            tiny_llama(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, vocab=512), "bench-llama"
        )
    a = full_model(bs)
    torch.set_num_threads(1)
    tau = layer_time(a, args.prompt)
    L = args.layers
    gap = L * tau / args.overload
    load = args.load_ratio * tau
    prompts = [torch.randint(0, 512, (args.prompt,)) for _ in range(n)]
    ref = [int(a.logits(a.run_layers(0, L, a.embed(p), SequenceKV(), 0)[-1:])[0].argmax()) for p in prompts]
    migrate = asyncio.run(activation_time(a, args.prompt))
    prefix = ilp_config(PairSetting(L, args.load_ratio, n, migrate / tau))
    print(f"activation hand-off over TCP: {migrate * 1e3:.2f} ms ({migrate / tau:.2f} layer times)")
    print(
        f"layer time {tau * 1e3:.2f} ms, {L} layers, load {load * 1e3:.1f} ms/layer, {n} requests every "
        f"{gap * 1e3:.1f} ms"
    )
    rounds = args.rounds or (1 if not args.realtime else 3 if args.quick else 5)
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    all_jobs: list[dict[str, list[Job]]] = []
    for r in range(rounds):  # modes interleaved per round: machine noise hits all of them alike
        res: dict[str, list[Job]] = {}
        for mode in MODES:
            if args.realtime:
                res[mode] = run_mode(mode, bs, a, prompts, gap, load, prefix)
            else:
                res[mode] = run_virtual(mode, bs, a, prompts, L / args.overload, args.load_ratio, prefix, migrate / tau)
                for j in res[mode]:  # clock units -> seconds
                    j.arrival, j.finish = j.arrival * tau, (j.finish or 0.0) * tau
        p99r = {m: float(np.percentile([(j.finish or 0) - j.arrival for j in js], 99)) for m, js in res.items()}
        for m in MODES:
            ratios[m].append(p99r[m] / p99r["stop-the-world"])
        print(
            f"round {r + 1}/{rounds}: p99 TTFT ms "
            + ", ".join(f"{m} {v * 1e3:.0f}" for m, v in p99r.items())
            + "; layers on B "
            + ", ".join(f"{m} {sum(j.on_b for j in js)}/{n * L}" for m, js in res.items())
        )
        all_jobs.append(res)
    med = {m: float(np.median(v)) for m, v in ratios.items()}
    res = all_jobs[int(np.argsort(ratios["zigzag"])[len(ratios["zigzag"]) // 2])]  # the median round, for the plot
    p99 = {m: float(np.percentile([(j.finish or 0) - j.arrival for j in js], 99)) for m, js in res.items()}
    exact_modes = all(j.token == ref[j.i] for rr in all_jobs for js in rr.values() for j in js)
    exact_tcp = asyncio.run(split_over_tcp(bs, [p.tolist()[:12] for p in prompts[:3]], L // 2))
    pair = asyncio.run(engine_pair(bs, [p.tolist()[:12] for p in prompts[:6]], L // 2))
    print(f"engine pair (real batched engines, one TCP connection): {pair}")
    eng = Engine(full_model(bs))
    t0 = time.perf_counter()
    out = eng.generate(prompts[0].tolist()[:16], SamplingParams(max_tokens=32))
    tps = len(out) / (time.perf_counter() - t0)
    result = {
        "p99_ttft_zigzag_over_stop": med["zigzag"],
        "p99_ttft_besteffort_over_stop": med["best-effort"],
        "p99_ttft_zigzag_ilp_over_stop": med["zigzag-ilp"],
        "ratios_per_round": ratios,
        "rounds": rounds,
        **pair,
        "split_exact": bool(exact_modes and exact_tcp and pair["split_exact_batched"]),
        "split_exact_modes": exact_modes,
        "split_exact_tcp": exact_tcp,
        "tokens_per_s_single": tps,
        "p99_ttft_s": p99,
        "layer_time_s": tau,
        "layers": L,
        "requests": n,
        "load_ratio": args.load_ratio,
        "migrate_s": migrate,
        "clock": "wall" if args.realtime else "layer (1 unit = measured layer time)",
        "overload": args.overload,
        "quick": args.quick,
        "link": "emulated by block arrival times (l+1)*load_ratio*layer_time; activations handed over in-process "
        "here, over TCP in split_exact_tcp and tests/engine/test_split.py",
    }
    if not args.no_real:
        result.update(livereal.real_section(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live.json").write_text(json.dumps(result, indent=2))
    plot(res, args.prompt, args.out / "live.png")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, str, list))}, indent=2))


def plot(res: dict[str, list[Job]], tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(j.finish or 0 for js in res.values() for j in js)
    ts, w = np.linspace(0, end, 200), end / 8  # sliding window: tokens finished in (t - w, t] / w
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in ("stop-the-world", "best-effort", "zigzag"):
        done = np.array(sorted(j.finish or 0.0 for j in res[mode]))
        rate = (np.searchsorted(done, ts, "right") - np.searchsorted(done, ts - w, "right")) * tokens / w
        ax.plot(ts, rate, label=mode)
    ax.set_xlabel("time since burst start (s)")
    ax.set_ylabel("prefill tokens/s completed")
    ax.set_title("Live scaling: throughput over time (A overloaded, B loading)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
