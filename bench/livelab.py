"""Live scaling on real engines over real weight transfers: engine processes in network namespaces joined
by tbf-limited links (netlab.py), weights streamed by the data plane (`load-plan`), requests sent over
HTTP by a trace driver in a namespace of its own, TTFT taken from the streamed responses.

Fleets (each one lab; modes run one after another on the same engines, same trace):
  pair   source A (host 0) + loading target B (host 1), chain plan:
         stop-the-world (B takes requests once complete) | best-effort | zigzag | zigzag-ilp
         (B pairs with A at once: `cooperate`, B serves its requests split with A as blocks land)
  pipeK  K sources + K targets, λScale binomial plan with K sub-groups (each target gets a different
         chunk first): stop-the-world | pipeline (the targets form one execution pipeline as soon as
         together they hold every layer: kascade_operator.livewiring's rule and calls)
The driver routes each request with the router's rules to the best of all servable engines (sources always;
a loading target when live, a complete one always), every mode alike: `route` "ttft" (the default) the least
expected time to first token (kascade_router.firsttoken: each engine's first-token rate and latency as the
driver measured them in this mode, the others' medians before it has its own), "share" the least (in flight
+ 1) / weight (a live loading target weighing the serving share its engine last reported,
kascade_router's prior before that). The shares are refreshed like the router's: from each answer
and by the router's own poller (kascade_router.shares.ShareRefresher, /readyz every 0.25 s).
With `redirect` "both", once a pipeline forms every source is told `cooperate {peer: the head,
mode: redirect}` and the head the same about every source: each hands requests still queued on it to the
other while its queue is the longer in serving shares (kascade_engine.live.liveredirect); "sources": only the
sources hand theirs to the head; "off" (the default: both ways measured worse, ADR 0008):
none. Compute is emulated per step
(`--emulate-layer-ms` on every engine: a step's layer work takes at least that long per layer forward),
so the engines' speed does not depend on the other processes of a shared 2-core box; the transfers,
the activations and HTTP are real.

Data flow: NetLab -> engine processes (`kascade engine serve`, one per namespace) -> the driver enters
the client namespace (setns) -> per mode: release+bind targets, load-plan everyone, cooperate (live
modes), trace of requests at a fixed rate (an overload of the sources' measured capacity) -> TTFT per
request, texts (equal across modes: `split_exact`).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import random
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import netlab

from kascade_operator.livewiring import chain_to_form
from kascade_operator.plandriver import POLL_S
from kascade_planner.binomial import build_binomial
from kascade_planner.builder import make_plan
from kascade_planner.engine_api import (
    SERVING_SHARE_HEADER,
    BindRequest,
    CooperateRequest,
    LoadPlanRequest,
    ZigZagSpec,
)
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import Node, Topology
from kascade_router.backends import LIVE_PRIOR_WEIGHT, Backend, Routes
from kascade_router.balancer import least_ttft, share_key
from kascade_router.firsttoken import FirstTokens
from kascade_router.settings import RouterSettings
from kascade_router.shares import ShareRefresher

TOKEN = "live-bench-" + secrets.token_hex(4)
MODEL = "bench-llama"
CLONE_NEWNET = 0x40000000


@dataclass
class Eng:
    iid: str
    host: int
    addr: str
    proc: subprocess.Popen[str]
    http: str = ""
    act: str = ""
    status: dict[str, Any] = field(default_factory=dict)


def enter_netns(name: str) -> None:
    """Move this thread (the main thread, before the driver starts any other) into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


def start_engine(lab: netlab.NetLab, host: int, iid: str, ckpt: Path, empty: bool, layer_ms: float,
                 batch_tokens: int, knee_tokens: int = 0) -> Eng:
    addr = lab.addr(host)
    logs = os.environ.get("KASCADE_BENCH_ENGINE_LOGS")  # a directory: each engine's stderr goes there
    verbose = ["-v"] if logs else []  # with logs kept: INFO, the per-request timeline (kascade_engine.batch.timeline)
    cmd = [
        *lab.prefix(host),
        sys.executable,
        "-m",
        "kascade_cli.main",
        *verbose,
        "engine",
        "serve",
        "--checkpoint",
        str(ckpt),
        "--model-name",
        MODEL,
        "--host",
        addr,
        "--port",
        "8000",
        "--act-port",
        "8001",
        "--threads",
        "1",
        "--max-batch-tokens",
        str(batch_tokens),
        "--emulate-layer-ms",
        str(layer_ms),
        "--emulate-knee-tokens",
        str(knee_tokens),
        *(["--empty"] if empty else []),
    ]
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
    err = open(Path(logs) / f"{lab.tag}-{iid}.log", "w") if logs else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "KASCADE_ENGINE_TOKEN": TOKEN})
    return Eng(iid, host, addr, proc)


def wait_ready(e: Eng, timeout: float = 300) -> None:
    assert e.proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = e.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {e.iid} exited with {e.proc.wait()}")
        if line.startswith("KASCADE_ENGINE_READY"):
            e.http, e.act = f"{e.addr}:8000", f"{e.addr}:8001"
            return
    raise RuntimeError(f"engine {e.iid} did not start in {timeout} s")


class Driver:
    """Control calls, status polling and the trace, from the client namespace."""

    def __init__(self, sources: list[Eng], targets: list[Eng], redirect: str = "off", route: str = "ttft") -> None:
        self.sources, self.targets, self.redirect, self.route = sources, targets, redirect, route
        # the router's view of the targets (a live replica's weight: kascade_router.backends), refreshed from
        # answers and by the router's share poller (`shares`)
        self.routes = Routes()
        self.routes.backends[("bench", MODEL)] = {t.iid: Backend(t.iid, t.http, LIVE_PRIOR_WEIGHT, live=True)
                                                  for t in targets}
        self.shares = ShareRefresher(self.routes, RouterSettings().live_share_refresh_s)
        # every engine as the balancer sees it (the sources: complete copies, weight 1; targets: the routes' live
        # backends), for their first tokens (kascade_router.firsttoken) and the routing rule
        self.balanced = {**{s.iid: Backend(s.iid, s.http) for s in sources},
                         **self.routes.backends[("bench", MODEL)]}
        self.t0 = time.monotonic()
        self.ids: dict[tuple[str, float], tuple[str, float]] = {}  # (prompt, at) -> (request id, unix time sent)
        self.events: list[tuple[float, str]] = []  # (unix time, what): the driver's side of a mode's timeline
        self.http = httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {TOKEN}"},
                                      limits=httpx.Limits(max_connections=512))

    async def ctl(self, e: Eng, verb: str, body: dict[str, Any] | None = None, get: bool = False) -> dict[str, Any]:
        url = f"http://{e.http}/kascade/v1/{verb}"
        r = await (self.http.get(url) if get else self.http.post(url, json=body or {}))
        if r.status_code >= 400:
            raise RuntimeError(f"{e.iid} {verb}: HTTP {r.status_code} {r.text[:300]}")
        out: dict[str, Any] = r.json()
        return out

    async def poll(self, stop: asyncio.Event, pipeline: list[Eng] | None) -> None:
        """The targets' statuses every `POLL_S` (the operator's plan driver's period: it polls the targets, never
        the sources); with `pipeline`, form it once its members cover every layer."""
        formed = False
        while not stop.is_set():
            # the targets only, as the operator: nothing here reads a source's status, and a source's answer
            # queues behind the weights it sends (up to the link's 0.3 s queue), which made every round, so the
            # pipeline's formation, wait 0.3-0.45 s more (ADR 0008)
            engines = tuple(self.targets)  # all at once: one slow engine must not age the others
            polled = time.time()
            for e, st in zip(engines, await asyncio.gather(*(self.ctl(e, "status", get=True) for e in engines)),
                             strict=True):
                e.status = st
            if pipeline and not formed:
                chain = chain_to_form([e.iid for e in pipeline], {e.iid: e.status for e in pipeline})
                if chain:
                    self.events += [
                        (polled, "covering statuses asked"),
                        (time.time(), f"chain {'->'.join(chain)} seen"),
                    ]
                    by = {e.iid: e for e in pipeline}
                    for a, b in reversed(list(itertools.pairwise(chain[1:]))):
                        await self.ctl(by[a], "cooperate", CooperateRequest(by[b].act, "pipeline").to_dict())
                        self.events.append((time.time(), f"hop {a}->{b} formed"))
                    head = by[chain[0]]  # its answer is its status: routable from this moment
                    head.status = await self.ctl(
                        head, "cooperate", CooperateRequest(by[chain[1]].act, "besteffort").to_dict()
                    )
                    self.events.append((time.time(), f"head {chain[0]} cooperating: routable"))
                    formed = True
                    print(f"    pipeline {'->'.join(chain)} formed at {time.monotonic() - self.t0:.2f} s", flush=True)
                    if (
                        self.redirect != "off"
                    ):  # queues move between the sources and the pipeline (BlitzScale's redirection)
                        await asyncio.gather(
                            *(
                                self.ctl(s, "cooperate", CooperateRequest(head.act, "redirect").to_dict())
                                for s in self.sources
                            )
                        )
                        for s in self.sources if self.redirect == "both" else ():  # and the head's to the sources
                            head.status = await self.ctl(
                                head, "cooperate", CooperateRequest(s.act, "redirect").to_dict()
                            )
            # the operator's period, not faster: a live target answers each status between its steps, and polled
            # every ~70 ms (50 ms + the round) ZigZag's p99 TTFT rose 0.1-0.2 s (pair ratio 0.52-0.55 against
            # 0.47-0.49 with the old ~0.45 s rounds)
            await asyncio.sleep(POLL_S)

    def servable(self, e: Eng, live: bool) -> bool:
        ph = e.status.get("phase")
        return e in self.sources or ph == "serving" or (live and ph == "live" and bool(e.status.get("cooperate")))

    def weight(self, e: Eng) -> float:
        """The router's weights (kascade_router.backends): a live, still loading replica weighs the share it
        last reported (its layers' share with a source, a pipeline head its receivers; LIVE_PRIOR_WEIGHT before
        its first answer), a complete copy 1."""
        return 1.0 if e in self.sources or e.status.get("phase") == "serving" else self.backend(e).weight

    def backend(self, e: Eng) -> Backend:
        return self.routes.backends[("bench", MODEL)][e.iid]

    def choose(self, cands: list[Eng]) -> Eng:
        """The router's rule over all servable engines: the least expected TTFT ("ttft":
        kascade_router.balancer.least_ttft, each engine's measured first-token rate and latency), or the least
        (in flight + 1) / weight ("share": kascade_router.balancer.share_key, the earlier rule, ADR 0009)."""
        if self.route == "share":
            return min(cands, key=lambda x: share_key(self.balanced[x.iid].in_flight, self.weight(x)))
        by = {e.iid: e for e in cands}
        b = least_ttft([self.balanced[e.iid] for e in cands], lambda b: self.weight(by[b.pod]))
        assert b is not None
        return by[b.pod]

    async def one(self, prompt: str, at: float, live: bool, max_tokens: int) -> tuple[float, str, str]:
        await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
        cands = [e for e in (*self.sources, *self.targets) if self.servable(e, live)]
        e = self.choose(cands)
        bk = self.balanced[e.iid]  # its in-flight count and first tokens, as the router keeps them
        bk.in_flight += 1
        first, text = None, ""
        sent = time.time()
        ft = bk.first_tokens
        t_sent = time.monotonic()
        ahead = ft.sent(t_sent)
        try:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            async with self.http.stream("POST", f"http://{e.http}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{e.iid}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                if e in self.targets:  # the router's rule (kascade_router.backends)
                    self.backend(e).reported(r.headers.get(SERVING_SHARE_HEADER))
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if first is None:
                            first = time.monotonic()
                            ft.first(first, first - t_sent, ahead)
                        chunk = json.loads(line[6:])
                        if "choices" not in chunk:  # the engine failed the request mid-stream: counted as failed
                            print(
                                f"      request to {e.iid} failed: {str(chunk.get('error', chunk))[:200]}", flush=True
                            )
                            return float("nan"), "", f"failed:{e.iid}"
                        text += chunk["choices"][0].get("text", "")
                        self.ids[(prompt, at)] = (str(chunk.get("id", "")), sent)
        except httpx.TransportError as err:  # counted and reported per mode ("failed"), never silently dropped
            print(f"      request to {e.iid} failed: {type(err).__name__}: {err}", flush=True)
            return float("nan"), "", f"failed:{e.iid}"
        finally:
            bk.in_flight -= 1
            if first is None:
                ft.gone(time.monotonic())
        return (first or time.monotonic()) - (self.t0 + at), text, e.iid

    async def capacity(self, n: int, prompt: str, max_tokens: int) -> float:
        """Requests per second one source completes under a burst of n."""
        self.t0 = time.monotonic()
        saved, self.targets = self.targets, []
        src = self.sources[:1]
        self.sources, keep = src, self.sources
        try:
            await asyncio.gather(*(self.one(prompt, 0.0, False, max_tokens) for _ in range(n)))
        finally:
            self.sources, self.targets = keep, saved
        return n / (time.monotonic() - self.t0)


def pair_plan(layout: ModelLayout, srcs: list[Eng], tgts: list[Eng], k: int, rate_mbit: int) -> dict[str, Any]:
    topo = Topology(tuple(Node(f"h{e.host}", "leaf", f"h{e.host}", 1, rate_mbit / 1000) for e in (*srcs, *tgts)))
    si = [Instance(e.iid, f"h{e.host}") for e in srcs]
    ti = [Instance(e.iid, f"h{e.host}") for e in tgts]
    if k <= 1:
        return make_plan(topo, layout, si, ti, "chain", predict=False, shard=False).to_dict()
    plan = build_binomial(layout, si, ti, k=k)
    plan.validate()
    return plan.to_dict()


async def run_mode(
    d: Driver,
    mode: str,
    plan: dict[str, Any],
    manifest: dict[str, Any],
    port: int,
    prompts: list[str],
    gap: float,
    max_tokens: int,
    zz: ZigZagSpec | None,
) -> list[tuple[float, str, str]]:
    for b in d.balanced.values():  # every mode starts with nothing measured (the same conditions for each)
        b.first_tokens = FirstTokens()
    for t in d.targets:  # a fresh target: no weights, bound, then loading by the plan
        d.backend(t).weight = LIVE_PRIOR_WEIGHT
        if t.status.get("phase") not in (None, "empty", "released"):
            await d.ctl(t, "release")
        await d.ctl(t, "bind", BindRequest(MODEL, "bench", "colocated").to_dict())
        t.status = await d.ctl(t, "status", get=True)
    peers = {e.iid: f"{e.addr}:{port}" for e in (*d.sources, *d.targets)}
    tok = secrets.token_hex(8)
    d.t0 = time.monotonic()
    d.events = [(time.time(), "trace t0 (load-plan calls start)")]
    for e in (*d.sources, *d.targets):
        await d.ctl(e, "load-plan", LoadPlanRequest(plan, e.iid, peers, tok, manifest, timeout_seconds=60).to_dict())
        d.events.append((time.time(), f"load-plan {e.iid} accepted"))
    live = mode != "stop-the-world"
    if mode in ("best-effort", "zigzag", "zigzag-ilp"):
        m = "besteffort" if mode == "best-effort" else "zigzag"
        for t in d.targets:
            t.status = await d.ctl(t, "cooperate",
                                   CooperateRequest(d.sources[0].act, m, zz if m == "zigzag" else None).to_dict())
    stop = asyncio.Event()
    poller = asyncio.create_task(d.poll(stop, d.targets if mode == "pipeline" else None))
    d.shares.start()
    try:
        out = await asyncio.gather(*(d.one(p, i * gap, live, max_tokens) for i, p in enumerate(prompts)))
        while any(t.status.get("phase") != "serving" for t in d.targets):  # the next mode starts from scratch
            if poller.done():  # a dead poller would leave these statuses stale forever: say why instead
                poller.result()
                raise RuntimeError("the status poller stopped before every target was serving")
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await poller
        await d.shares.close()
    if mode == "pipeline" and d.redirect != "off":  # the sources stop handing their queues over
        for s in d.sources:
            await d.ctl(s, "cooperate", CooperateRequest("", "off").to_dict())
    for t in d.targets:  # stop cooperating before the release
        await d.ctl(t, "cooperate", CooperateRequest("", "off").to_dict())
    return list(out)


@dataclass(frozen=True)
class Setup:
    rate_mbit: int
    layer_ms: float
    batch_tokens: int
    prompt_chars: int
    max_tokens: int
    overload: float
    load_s: float  # the whole model over one link, by construction of rate_mbit
    max_requests: int
    knee_tokens: int = 0  # emulation: a layer forward over more tokens costs proportionally more (0: never)
    link_qos: bool = False  # True: links send the activation class first (netlab.py, "QoS"); False: one FIFO per link
    redirect: str = "off"  # pipelines: queues move sources <-> the formed pipeline ("both"), sources -> it, or "off"
    route: str = (
        "ttft"  # the driver's routing rule, every mode alike: expected TTFT ("ttft") or (in flight + 1) / weight
    )


def fleet(kind: str, k: int, modes: tuple[str, ...], ckpt: Path, manifest: dict[str, Any], layout: ModelLayout,
          setup: Setup, tag: str) -> dict[str, list[tuple[float, str, str]]]:
    """One lab of k sources + k targets (+ the client), every mode on the same trace. TTFT per request."""
    hosts = 2 * k + 1
    with netlab.NetLab(hosts, setup.rate_mbit, prefix=tag, qos=setup.link_qos) as lab:
        srcs = [
            start_engine(lab, i, f"s{i}", ckpt, False, setup.layer_ms, setup.batch_tokens, setup.knee_tokens)
            for i in range(k)
        ]
        tgts = [
            start_engine(lab, k + j, f"t{j}", ckpt, True, setup.layer_ms, setup.batch_tokens, setup.knee_tokens)
            for j in range(k)
        ]
        try:
            for e in (*srcs, *tgts):
                wait_ready(e)
            plan = pair_plan(layout, srcs, tgts, k if kind == "pipe" else 1, setup.rate_mbit)
            if kind == "pipe":
                print(f"  {kind}{k}: plan pipelines {plan.get('pipelines')}", flush=True)
            return asyncio.run(_drive(lab, tag, hosts - 1, srcs, tgts, modes, plan, manifest, layout, setup))
        finally:
            for e in (*srcs, *tgts):
                e.proc.terminate()
            for e in (*srcs, *tgts):
                try:
                    e.proc.wait(10)
                except subprocess.TimeoutExpired:
                    e.proc.kill()


async def _drive(lab: netlab.NetLab, tag: str, client: int, srcs: list[Eng], tgts: list[Eng], modes: tuple[str, ...],
                 plan: dict[str, Any], manifest: dict[str, Any], layout: ModelLayout,
                 setup: Setup) -> dict[str, list[tuple[float, str, str]]]:
    origin = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    enter_netns(f"{tag}-h{client}")
    d = Driver(srcs, tgts, setup.redirect, setup.route)
    try:
        for e in (*srcs, *tgts):
            e.status = await d.ctl(e, "status", get=True)
        prompt = "x" * setup.prompt_chars
        cap = await d.capacity(48, prompt, setup.max_tokens)  # long enough for steady continuous batching
        gap = 1.0 / (setup.overload * cap * len(srcs))
        n = min(setup.max_requests, max(16, round(1.5 * setup.load_s / gap)))  # the trace outlasts the load
        rng = random.Random(0)
        prompts = ["".join(rng.choice("abcdefghijklmnop ") for _ in range(setup.prompt_chars)) for _ in range(n)]
        per_block = setup.load_s / len(layout.block_ids)
        zz = ZigZagSpec(per_block / (setup.layer_ms / 1e3), 12)  # the planner's setting: 12 batches planned
        print(f"  source capacity {cap:.1f} req/s (burst of 48); {n} requests every {gap * 1e3:.1f} ms "
              f"({setup.overload}x the sources); ZigZag loadRatio {zz.load_ratio:.0f}", flush=True)
        out: dict[str, list[tuple[float, str, str]]] = {}
        for i, mode in enumerate(modes):
            spec = zz if mode != "zigzag-ilp" else ZigZagSpec(zz.load_ratio, zz.batches, True)
            t = time.monotonic()
            out[mode] = await run_mode(d, mode, plan, manifest, 7100 + i, prompts, gap, setup.max_tokens, spec)
            if logs := os.environ.get("KASCADE_BENCH_ENGINE_LOGS"):  # per request, to join with the engines' timelines
                rows = [[j, j * gap, x[0], x[2], *d.ids.get((p, j * gap), ("", 0.0))]
                        for j, (p, x) in enumerate(zip(prompts, out[mode], strict=True))]
                Path(logs, f"{tag}-{mode}-requests.json").write_text(json.dumps(
                    {"gap": gap, "columns": ["i", "at_s", "ttft_s", "engine", "id", "sent_unix"], "rows": rows,
                     "driver_events": d.events}))
                d.ids.clear()
            ttft = sorted(x[0] for x in out[mode] if x[2][:7] != "failed:")
            if len(ttft) < n:
                print(f"      {n - len(ttft)} of {n} requests failed (left out of the TTFT figures)", flush=True)
            on_t = sum(1 for x in out[mode] if x[2].startswith("t"))
            by = {w: [x[0] for x in out[mode] if x[2].startswith(w)] for w in ("s", "t")}
            print("      mean TTFT on sources / targets: " + " / ".join(
                f"{1e3 * sum(v) / len(v):.0f} ms" if v else "-" for v in by.values()), flush=True)
            print(f"    {mode:15s} mean TTFT {1e3 * sum(ttft) / len(ttft):7.1f} ms, "
                  f"p99 {1e3 * ttft[int(0.99 * (len(ttft) - 1))]:7.1f} ms; "
                  f"{on_t}/{n} served by targets; {time.monotonic() - t:.1f} s", flush=True)
        return out
    finally:
        await d.http.aclose()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(origin, CLONE_NEWNET)
        os.close(origin)
