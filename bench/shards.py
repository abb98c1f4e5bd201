#!/usr/bin/env python3
"""Operator sharding, measured side by side in one run: one process (`--shards 1`, a leader) against K replicas
with `--shards K`, on one real API server with KWOK nodes and loopback engine stand-ins (as bench/operator_scale.py).

Set-up: N fake GPU nodes; K namespaces, each its own warm pool (a service's shard is its pool namespace's,
sharding.py), chosen so each shard gets one; M ModelServices spread over them, each bound by the first operator
(one process, the leader of 1 shard). Then, per configuration, each started afresh on the bound cluster and
once every service had a round there, a steady window: rounds run (all triggers), CPU
seconds per second and RSS per operator process, and rounds per second in total. Then the K replicas: the
holder of one shard is SIGKILLed and the time until a survivor holds it is printed (the chart's lease timings:
15 s, 10 s renew deadline, 2 s retry; with a 5 s deadline a replica starting at 2,000 nodes missed its renewal
and exited).
Writes bench/results/shards.json.

    python bench/shards.py --scale 2000,200 --shards 2 --steady 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from operator_scale import STUB_PROCS, _cpu_s, _rounds_so_far, _rss_mb, fleet
from stubhost import StubHost

from kascade_devcluster import nodes as devnodes
from kascade_devcluster.api import install_crds
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.ports import free_ports
from kascade_devcluster.waiting import wait_for
from kascade_operator.sharding import shard_of

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
LEASE = ("--lease-duration", "15", "--lease-renew-deadline", "10", "--lease-retry", "2")  # the chart's defaults


def namespaces(k: int) -> list[str]:
    """One pool namespace per shard of k."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < k:
        out.setdefault(shard_of(f"pool-{i}", k), f"pool-{i}")
        i += 1
    return [out[s] for s in range(k)]


def _rss(pid: int) -> float:
    """RSS in MB; 0 when the process has exited (a replica that lost its shards exits)."""
    try:
        return _rss_mb(pid)[0]
    except (KeyError, OSError):
        return 0.0


def window(cp: ControlPlane, ops: list[tuple[OperatorProcess, int]], steady_s: float) -> dict[str, Any]:
    """Rounds, CPU and RSS of each operator process over a steady window."""
    pids = [o.proc.pid for o, _ in ops if o.proc is not None]
    r0, c0, t0 = [_rounds_so_far(p)[0] for _, p in ops], [_cpu_s(p) for p in pids], time.monotonic()
    time.sleep(steady_s)
    r1, c1, dt = [_rounds_so_far(p)[0] for _, p in ops], [_cpu_s(p) for p in pids], time.monotonic() - t0
    per = [{"rounds_per_s": round((b - a) / dt, 2), "cpu_s_per_s": round((d - c) / dt, 3),
            "ms_cpu_per_round": round(1000 * (d - c) / max(1.0, b - a), 2), "rss_mb": round(_rss(pid))}
           for a, b, c, d, pid in zip(r0, r1, c0, c1, pids, strict=True)]
    return {"processes": per, "rounds_per_s": round(sum(p["rounds_per_s"] for p in per), 2),
            "cpu_s_per_s": round(sum(p["cpu_s_per_s"] for p in per), 3),
            "max_process_cpu_s_per_s": max(p["cpu_s_per_s"] for p in per)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="2000,200", help="N,M: nodes and ModelServices")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steady", type=float, default=30.0, help="seconds of each steady window")
    ap.add_argument("--interval", type=float, default=1.0, help="operator metric interval (s)")
    a = ap.parse_args()
    n_nodes, n_svc = (int(x) for x in a.scale.split(","))
    spec = importlib.util.spec_from_file_location("enginestub", REPO / "tests/operator/enginestub.py")
    assert spec and spec.loader
    stub_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub_mod)
    nss = namespaces(a.shards)
    out: dict[str, Any] = {"nodes": n_nodes, "services": n_svc, "shards": a.shards, "namespaces": nss}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        cp = ControlPlane.create(tmp / "cp").start(node_grace_s=900)
        ops: list[tuple[OperatorProcess, int]] = []
        host: StubHost | None = None
        try:
            install_crds(cp)
            for ns in [*nss, "ops"]:
                cp.kubectl("create", "namespace", ns)
            specs = fleet(cp, n_nodes)
            names = [f"e{i}" for i in range(n_svc + 2 * a.shards)]
            host = StubHost(Path(stub_mod.__file__), names, TOKEN, STUB_PROCS)
            ports = free_ports(len(names))
            pods: dict[str, list[dict[str, Any]]] = {ns: [] for ns in nss}
            for i, s in enumerate(host.stubs):
                pods[nss[i % len(nss)]].append({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": f"e{i}", "labels": {"kascade.io/pool": "warm"},
                                    "annotations": {"kascade.io/endpoint": s.endpoint, "kascade.io/model": "tiny",
                                                    "kascade.io/data-endpoint": f"127.0.0.1:{ports[i]}"}},
                       "spec": {"nodeName": specs[i % len(specs)].name, "containers": [{"name": "e", "image": "x"}],
                                "tolerations": [devnodes.KWOK_TOLERATION]}})
            for ns, items in pods.items():
                cp.kubectl("-n", ns, "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                           "items": items}))
            watch = tuple(x for ns in nss[1:] for x in ("--namespace", ns))

            def start(name: str, shards: int) -> tuple[OperatorProcess, int]:
                (port,) = free_ports(1)
                return OperatorProcess(cp, nss[0], TOKEN, tmp / f"{name}.log", interval=a.interval, extra_args=(
                    *watch, "--leader-elect", "--lease-namespace", "ops", *LEASE, "--shards", str(shards),
                    "--identity", name, "--metrics-port", str(port), "--engine-image", "x",
                    "--allowed-host-path-root", "/m")).start(), port

            ops.append(start("one", 1))
            t0 = time.monotonic()
            svcs = [{"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": f"svc{i}"},
                     "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4},
                              "engine": {"image": "x"}, "replicas": {"colocated": {"min": 1, "max": 2}},
                              "scaling": {"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}}}}
                    for i in range(n_svc)]
            for k, ns in enumerate(nss):
                mine = svcs[k::len(nss)]
                for j in range(0, len(mine), 50):
                    cp.kubectl("-n", ns, "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                               "items": mine[j:j + 50]}))

            def loaded() -> int:
                items = json.loads(cp.kubectl("get", "pods", "-A", "-l", "kascade.io/model-service", "-o",
                                              "json").stdout)["items"]
                return sum((p["metadata"].get("annotations") or {}).get("kascade.io/loaded") == "true" for p in items)

            wait_for(lambda: loaded() >= n_svc, 900, "every service bound and loaded", poll=5.0)
            out["setup_s"] = round(time.monotonic() - t0, 1)
            print(f"shards: {n_svc} services bound by one process in {out['setup_s']} s", flush=True)
            ops.pop()[0].stop()  # each configuration starts afresh on the bound cluster, as a takeover would
            ops.append(start("one", 1))
            wait_for(lambda: _rounds_so_far(ops[0][1])[1] >= n_svc, 600, "every service's round", poll=1.0)
            out["one_process"] = window(cp, ops, a.steady)
            print(f"shards: 1 process: {out['one_process']}", flush=True)
            ops.pop()[0].stop()
            ops.extend(start(f"r{k}", a.shards) for k in range(a.shards))

            def holders() -> dict[int, str]:
                items = json.loads(cp.kubectl("-n", "ops", "get", "leases", "-l", "kascade.io/lease-role=shard",
                                              "-o", "json").stdout)["items"]
                return {int(x["metadata"]["labels"]["kascade.io/shard"]): x["spec"].get("holderIdentity") or ""
                        for x in items}
            wait_for(lambda: len(set(holders().values()) - {""}) == a.shards, 300, "one shard per replica", poll=1.0)
            wait_for(lambda: sum(_rounds_so_far(p)[1] for _, p in ops) >= n_svc, 600, "every service's round")
            out["sharded"] = window(cp, ops, a.steady)
            print(f"shards: {a.shards} processes: {out['sharded']}", flush=True)
            victim = holders()[0]
            next(o for o, _ in ops if o.log.name == f"{victim}.log").kill()
            t_kill = time.monotonic()
            wait_for(lambda: holders().get(0) not in ("", victim), 120, "a survivor takes shard 0", poll=0.2)
            out["takeover_s"] = round(time.monotonic() - t_kill, 2)
            print(f"shards: shard 0 taken over {out['takeover_s']} s after SIGKILL of {victim} (lease 15 s)",
                  flush=True)
        finally:
            for o, _ in ops:
                o.stop()
            if keep := os.environ.get("KASCADE_BENCH_KEEP"):  # the operators' logs outlive the run
                Path(keep).mkdir(parents=True, exist_ok=True)
                for f in tmp.glob("*.log"):
                    (Path(keep) / f.name).write_bytes(f.read_bytes())
            if host is not None:
                for s in host.stubs:
                    s.close()
            cp.stop()
    dest = REPO / "bench" / "results" / "shards.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
