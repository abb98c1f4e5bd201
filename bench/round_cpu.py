#!/usr/bin/env python3
"""CPU per reconcile round, in process, and how it grows with the number of ModelServices.

Set-up per size N: the in-memory kube layer of the operator tests (tests/operator/fakekube.py) with 10 x N
GPU nodes, N + 4 pool pods of which N are bound (loaded, Ready) one per ModelService and one idle pod keeps
the model in host memory (the keeper's O(1) copies per model), N ModelServices
(threshold policy, min 1 max 2) and a finished ScalePlan each; the pool and plans are handed to the
Runtime as its watch indexes (what kopf gives the real operator). Metrics come from a source that answers
at once (no HTTP: this measures the round, not the scrape). Then every service gets `--rounds` steady
rounds (`handlers.reconcile_service`, trigger "update": observe -> decide -> act), and the process CPU per
round is printed with its split between observe, decide and act. `--profile`: cProfile of the largest
size, top functions by own time.

Prints a table at 20, 200 and 1,000 services (`--sizes`) and writes bench/results/round_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kascade_operator import labels as L
from kascade_operator import runtime as runtime_mod
from kascade_operator.engine_client import EngineClient
from kascade_operator.handlers import reconcile_service
from kascade_operator.metrics import InstanceLoad, Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[1]
NS, TOKEN = "scale", "t"


def _fakekube() -> Any:
    """The fake kube layer of the tree whose operator runs (`--compare`: an older tree's operator with this tree's
    fake layer failed to import, the layer follows kube.py's API)."""
    import kascade_operator

    tree = Path(kascade_operator.__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("fakekube", tree / "tests/operator/fakekube.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fakekube"] = mod
    spec.loader.exec_module(mod)
    return mod.FakeKube


class Instant:
    """A metrics source that answers at once with no load (rounds read it as they read the sweep's view)."""

    async def collect(self, pods: Any) -> list[InstanceLoad]:
        return []


def build(n: int) -> tuple[Runtime, list[dict[str, Any]]]:
    kube = _fakekube()()
    kube.nodes = [{"metadata": {"name": f"n{i}", "labels": {"kascade.io/leaf": f"l{i // 32}",
                                                             "kascade.io/nic-gbps": "100"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}
                  for i in range(10 * n)]
    plans = []
    for i in range(n + 4):
        kube.add_pool_pod(NS, f"e{i}", f"n{i}", f"127.0.0.1:{10000 + i}", model="tiny")
        if i < n:
            meta = kube.pods[(NS, f"e{i}")]["metadata"]
            meta["labels"].update({L.MODEL_SERVICE: f"svc{i}", L.ROLE: "colocated", L.POOL: L.POOL_BOUND})
            meta["annotations"].update({L.LOADED: "true", L.PLAN: f"svc{i}-p"})
            plans.append({"metadata": {"name": f"svc{i}-p", "namespace": NS,
                                       "creationTimestamp": "2026-12-06T07:00:00Z"},
                          "spec": {"modelServiceRef": {"name": f"svc{i}"}, "role": "colocated",
                                   "targets": [{"pod": f"e{i}", "instance": f"e{i}"}]},
                          "status": {"phase": "Succeeded", "completionTime": "2026-12-06T07:00:05Z"}})
    kube.pods[(NS, f"e{n}")]["metadata"]["annotations"][L.HOST_COPY] = "tiny"  # the pool keeps one copy
    settings = OperatorSettings(engine_token=TOKEN, engine_image="x", allowed_host_path_roots=["/m"])
    rt = Runtime(settings, kube, EngineClient(TOKEN), Scraper(), None, OperatorMetrics())
    rt.prometheus = Instant()  # type: ignore[assignment]
    if hasattr(rt, "node_watch"):  # nodes by list + watch (nodefacts.py), filled as its first list would
        from kascade_operator.nodefacts import NodeFacts
        rt.node_watch = NodeFacts(settings.leaf_label, settings.gpu_resource)
        rt.node_watch.replace(kube.nodes, "1")
        rt.attach({NS: list(kube.pods.values())}, {NS: plans}, {})
    else:  # an older tree (--compare): nodes as a kopf index under one key
        rt.attach({NS: list(kube.pods.values())}, {NS: plans}, {runtime_mod.ALL: kube.nodes}, {})  # type: ignore

    bodies = [{"metadata": {"name": f"svc{i}", "namespace": NS, "uid": f"u{i}", "generation": 1},
               "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4}, "engine": {"image": "x"},
                        "replicas": {"colocated": {"min": 1, "max": 2}},
                        "scaling": {"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}}},
               "status": {}} for i in range(n)]
    return rt, bodies


async def measure(n: int, rounds: int, prof: cProfile.Profile | None = None) -> dict[str, float]:
    rt, bodies = build(n)
    split = {"observe": 0.0, "decide": 0.0, "act": 0.0}

    def timed(name: str, fn: Any) -> Any:
        async def a(*args: Any, **kw: Any) -> Any:
            t = time.process_time()
            try:
                return await fn(*args, **kw)
            finally:
                split[name] += time.process_time() - t

        def s(*args: Any, **kw: Any) -> Any:
            t = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                split[name] += time.process_time() - t
        return a if asyncio.iscoroutinefunction(fn) else s

    import kascade_operator.handlers as H
    split_known = all(hasattr(H, f) for f in ("observe", "decide", "act"))  # (a baseline tree may not split)
    orig = (H.observe, H.decide, H.act) if split_known else None
    if split_known:
        H.observe, H.decide, H.act = timed("observe", H.observe), timed("decide", H.decide), timed("act", H.act)
    try:
        for b in bodies:  # the first round writes each status; the measured ones are steady
            await reconcile_service(rt, b, "update")
            written: dict[str, Any] = rt.kube.service_status  # type: ignore[attr-defined]  # (FakeKube's record)
            b["status"] = json.loads(json.dumps(written))  # as the watch would show it
        for k in split:
            split[k] = 0.0
        if prof is not None:
            prof.enable()
        t0 = time.process_time()
        for _ in range(rounds):
            for b in bodies:
                await reconcile_service(rt, b, "update")
        cpu = time.process_time() - t0
        if prof is not None:
            prof.disable()
    finally:
        if orig is not None:
            H.observe, H.decide, H.act = orig
        await rt.engines.aclose()
    per = n * rounds
    return {"services": float(n), "cpu_ms_per_round": round(1000 * cpu / per, 3),
            **{f"{k}_ms_per_round": round(1000 * v / per, 3) for k, v in split.items()},
            "cpu_s_per_s_at_1_round_per_service_per_s": round(cpu / rounds, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="20,200,1000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compare", metavar="REF", help="git ref: the same sizes with its operator first (a child "
                    "process on its unpacked tree), then this tree's, interleaved per size")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one size's row, for --compare
    a = ap.parse_args()
    if a.json:
        print(json.dumps(asyncio.run(measure(int(a.sizes), a.rounds))))
        return
    if a.compare:
        compare(a.compare, [int(x) for x in a.sizes.split(",")], a.rounds)
        return
    sizes = [int(x) for x in a.sizes.split(",")]
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'services':>9} {'ms/round':>9} {'observe':>8} {'decide':>8} {'act':>8} {'CPU s/s at 1 round/svc/s':>25}")
    for n in sizes:
        prof = cProfile.Profile() if a.profile and n == sizes[-1] else None
        r = asyncio.run(measure(n, a.rounds, prof))
        rows.append(r)
        print(f"{n:>9} {r['cpu_ms_per_round']:>9.3f} {r['observe_ms_per_round']:>8.3f} {r['decide_ms_per_round']:>8.3f}"
              f" {r['act_ms_per_round']:>8.3f} {r['cpu_s_per_s_at_1_round_per_service_per_s']:>25.3f}", flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"load average {os.getloadavg()[0]:.1f}")
    out = REPO / "bench" / "results" / "round_cpu.json"
    out.write_text(json.dumps({"rows": rows, "loadavg_1m": os.getloadavg()[0]}, indent=1) + "\n")


def compare(ref: str, sizes: list[int], rounds: int) -> None:
    """Per size, REF's operator then this tree's, each in a fresh child process (same fake cluster)."""
    with tempfile.TemporaryDirectory(prefix="kascade-round-cpu-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        dirs = ("planner", "cli", "operator", "engine", "sim", "e2e", "router")
        trees = {ref: [f"{tmp}/{d}" for d in dirs], "this tree": [str(REPO / d) for d in dirs]}
        print(f"load average {os.getloadavg()[0]:.1f}; CPU ms per steady round (observe -> decide -> act)")
        print(f"{'services':>9} {ref:>14} {'this tree':>10} {'ratio':>6}")
        rows = []
        for n in sizes:
            got = {}
            for label, path in trees.items():
                env = {**os.environ, "PYTHONPATH": ":".join(path)}
                out = subprocess.run([sys.executable, str(REPO / "bench" / "round_cpu.py"), "--json", "--sizes",
                                      str(n), "--rounds", str(rounds)], env=env, check=True, capture_output=True,
                                     text=True, cwd=tmp if label == ref else REPO).stdout
                got[label] = json.loads(out.strip().splitlines()[-1])["cpu_ms_per_round"]
            rows.append({"services": n, "base_ms": got[ref], "ms": got["this tree"]})
            print(f"{n:>9} {got[ref]:>14.3f} {got['this tree']:>10.3f} {got[ref] / got['this tree']:>5.1f}x",
                  flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
        out_file = REPO / "bench" / "results" / "round_cpu_compare.json"
        out_file.write_text(json.dumps({"ref": ref, "rows": rows, "loadavg_1m": os.getloadavg()[0]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
