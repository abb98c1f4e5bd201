#!/usr/bin/env python3
"""Operator benchmark on the real API server: reaction time from a metric crossing the policy's upper
bound to every scale-up target instructed over the engine control API.

Set-up: a private local control plane (kube-apiserver + etcd + KWOK), fake GPU nodes with topology
labels, warm-pool pods whose engines are loopback HTTP stand-ins (tests/operator/enginestub.py, real
HTTP), and `kascade operator run` as a separate process. Per round, one ModelService at min=1 gets a
load burst on its bound engine; reaction = last target's `bind` call time - the crossing time
(both on this host's monotonic clock), reported from the moment the operator's windowed tokens/s
metric crosses the bound (raise + window * upper / load) and, beside it, from the load raise itself.
Then failover (`failover_s`): two operator replicas with leader election on a Lease (3 s lease, 2 s
renew deadline, 1 s retry: the chart's default lease is 15 s), the leader SIGKILLed, a scale-up asked at
the same moment; failover = kill -> the standby's first `bind` call of a target of a ScalePlan created after
the kill. Beside it, kopf's own peering with
the same 3 s lifetime (bench/operator_peering.py: kill -> the standby's kopf handler). Then the scale run
(bench/operator_scale.py: 2,000 fake GPU nodes, 200 ModelServices; `--quick`: 200 and 20; `--operator-nice -10`:
the same steady window and reactions again with the operator at more CPU weight, as its pod's CPU request gives it
on a node, side by side with the unprioritized one, both printed). Writes
bench/results/operator.json. `--quick`: about a minute. (Named reaction.py: a bench/operator.py shadowed the
stdlib `operator` module for every script run from bench/.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from failover_scale import plan_names, run_failover_scale, standby_binds
from operator_peering import run_peering
from operator_scale import run_scale
from report import report

from kascade_devcluster import nodes as devnodes
from kascade_devcluster.api import install_crds
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"


def _stub_module() -> Any:
    spec = importlib.util.spec_from_file_location("enginestub", REPO / "tests/operator/enginestub.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kubectl_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl(*args, "-o", "json").stdout)


UPPER, LOAD = 1000.0, 5000.0  # threshold upper bound and the burst (tokens/s)


# the scale run's numbers (run_scale): every key starts so; the 20-service run and the failover write none of them
SCALE_KEYS = ("scale_", "base_", "nice_", "operator_", "reconcile_", "rounds_", "metrics_evaluated_")


def run(rounds: int, interval: float, window: float) -> dict[str, float | str]:
    stub_mod = _stub_module()
    with tempfile.TemporaryDirectory(prefix="kascade-bench-op-") as tmp:
        cp = ControlPlane.create(Path(tmp) / "cp").start()
        proc = None
        stubs: list[Any] = []
        try:
            install_crds(cp)
            ns = "bench"
            cp.kubectl("create", "namespace", ns)
            names = devnodes.create_nodes(cp, devnodes.topology_specs(8, 8, 2, prefix="bench-gpu"), "bench")
            by_pod = {}
            for i in range(2 * rounds):
                s = stub_mod.EngineStub(f"e{i}", "tiny", TOKEN)
                stubs.append(s)
                by_pod[f"e{i}"] = s
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": f"e{i}", "labels": {"kascade.io/pool": "warm"},
                                    "annotations": {"kascade.io/endpoint": s.endpoint, "kascade.io/model": "tiny",
                                                    "kascade.io/data-endpoint": f"127.0.0.1:{21000 + i}"}},
                       "spec": {"nodeName": names[i % len(names)], "containers": [{"name": "e", "image": "x"}],
                                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}]}}
                cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod))
            env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig)}
            log = open("/tmp/kascade-bench-operator.log", "wb")  # noqa: SIM115 - lives as long as the run
            proc = subprocess.Popen([str(Path(sys.executable).with_name("kascade")), "-v", "operator", "run",
                                     "--namespace", ns, "--interval", str(interval), "--engine-token", TOKEN,
                                     "--rate-window", str(window)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT)
            reactions: list[float] = []
            from_load: list[float] = []
            for r in range(rounds):
                name = f"svc{r}"
                doc = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": name},
                       "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4},
                                "engine": {"image": "x"}, "replicas": {"colocated": {"min": 1, "max": 2}},
                                "scaling": {"policy": "threshold", "intervalSeconds": interval,
                                            "threshold": {"upper": UPPER, "lower": 10}}}}
                cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))
                first = wait_for(lambda n=name: [p for p in _kubectl_json(cp, "-n", ns, "get", "pods", "-l",
                                                                       f"kascade.io/model-service={n}")["items"]
                                              if (p["metadata"].get("annotations") or {}).get("kascade.io/loaded")],
                              60, f"{name} min replica")
                src = by_pod[first[0]["metadata"]["name"]]
                time.sleep(2 * interval)  # one scrape at zero load first, so the rate starts from a baseline
                t_cross = time.monotonic()
                src.tokens_per_s = LOAD

                def new_binds(t0: float = t_cross) -> list[float]:
                    return [t for s in stubs for v, _, t in list(s.calls) if v == "bind" and t >= t0]

                t_done = max(wait_for(new_binds, 30, f"{name} scale-up"))  # 1 -> 2: one target
                # the windowed rate (0 -> 5000 tok/s) crosses the upper bound 1000 after window * 1000/5000
                metric_cross = t_cross + window * UPPER / LOAD
                from_load.append((t_done - t_cross) * 1000)
                reactions.append((t_done - metric_cross) * 1000)
                src.tokens_per_s = 100.0  # within bounds: stays at 2
                print(f"round {r}: reaction {reactions[-1]:.1f} ms after the metric crossed "
                      f"({from_load[-1]:.1f} ms after the load rose)", flush=True)
            rs, ls = sorted(reactions), sorted(from_load)
            return {"reaction_ms_p50": statistics.median(rs),
                    "reaction_ms_p99": rs[min(len(rs) - 1, int(0.99 * len(rs)))],
                    "reaction_from_load_ms_p50": statistics.median(ls),
                    "reaction_from_load_ms_p99": ls[min(len(ls) - 1, int(0.99 * len(ls)))],
                    "reaction_rounds": float(len(rs)), "metric_interval_ms": interval * 1000,
                    "rate_window_ms": window * 1000,
                    "note": "from the windowed metric crossing (raise + window*upper/load); includes up to one "
                            "metric interval of scrape delay"}
        finally:
            if proc:
                proc.terminate()
                proc.wait(15)
            for s in stubs:
                s.close()
            cp.stop()


def run_failover(lease_s: float = 3.0) -> dict[str, float | str]:
    """Leader SIGKILL -> the standby acting (its first bind), with a scale-up requested at the kill."""
    from kascade_devcluster.operatorproc import OperatorProcess

    stub_mod = _stub_module()
    with tempfile.TemporaryDirectory(prefix="kascade-bench-failover-") as tmp:
        cp = ControlPlane.create(Path(tmp) / "cp").start()
        ops: list[OperatorProcess] = []
        stubs: list[Any] = []
        try:
            install_crds(cp)
            ns = "failover"
            cp.kubectl("create", "namespace", ns)
            names = devnodes.create_nodes(cp, devnodes.topology_specs(2, 8, 1, prefix="fo-gpu"), "fo")
            for i in range(3):
                s = stub_mod.EngineStub(f"f{i}", "tiny", TOKEN)
                stubs.append(s)
                cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(
                    {"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"f{i}", "labels": {"kascade.io/pool": "warm"},
                                  "annotations": {"kascade.io/endpoint": s.endpoint, "kascade.io/model": "tiny"}},
                     "spec": {"nodeName": names[i % 2], "containers": [{"name": "e", "image": "x"}],
                              "tolerations": [devnodes.KWOK_TOLERATION]}}))
            ha = ("--leader-elect", "--lease-namespace", ns, "--lease-duration", str(lease_s),
                  "--lease-renew-deadline", str(lease_s * 2 / 3), "--lease-retry", "1")
            for who in ("a", "b"):
                ops.append(OperatorProcess(cp, ns, TOKEN, Path(tmp) / f"{who}.log", interval=0.1,
                                           extra_args=(*ha, "--identity", who)).start())
                if who == "a":
                    wait_for(lambda: "a leads" in ops[0].tail(), 30, "a leads")
            wait_for(lambda: "b: standby" in ops[1].tail(), 30, "b waits")
            doc = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "svc"},
                   "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4},
                            "engine": {"image": "x"}, "replicas": {"colocated": {"min": 1, "max": 3}}}}
            cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))
            wait_for(lambda: sum(s.count("bind") for s in stubs) == 1, 30, "min bound by the leader")
            time.sleep(1.0)
            before = plan_names(cp, ns)  # the leader's plans: binds of their targets never count
            ops[0].kill()
            t_kill = time.monotonic()
            cp.kubectl("-n", ns, "scale", "msvc", "svc", "--replicas=2")
            t_bind = wait_for(standby_binds(cp, ns, {f"f{i}": s for i, s in enumerate(stubs)}, before, t_kill),
                              60, "the standby's bind", poll=0.25)[0]
            failover = t_bind - t_kill
            print(f"failover: {failover:.2f} s (lease {lease_s:g} s)", flush=True)
            return {"failover_s": round(failover, 3), "failover_lease_s": lease_s,
                    "failover_note": "kubernetes_asyncio Lease election; kill -> standby's first engine bind "
                                     "of a plan created after the kill (includes the expiry of the dead "
                                     "leader's lease and one reconcile)"}
        finally:
            for o in ops:
                o.stop()
            for s in stubs:
                s.close()
            cp.stop()


def _unpack(ref: str, tmp: Path) -> Path:
    """The ref's tree, unpacked beside (no worktree: the repository is not touched)."""
    base = tmp / "base"
    base.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="few rounds (< 1 minute)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=0.1, help="operator metric interval (s)")
    ap.add_argument("--rate-window", type=float, default=1.0, help="operator tokens/s window (s)")
    ap.add_argument("--scale-nodes", type=int, default=2000)
    ap.add_argument("--scale-services", type=int, default=200)
    ap.add_argument("--scale", help="N,M: the scale run at N nodes and M ModelServices (sets --scale-nodes/-services)")
    ap.add_argument("--steady", type=float, help="seconds of the scale run's steady window (default 30; --quick 10)")
    ap.add_argument("--scale-interval", type=float, default=1.0, help="operator interval in the scale run (s)")
    ap.add_argument("--no-scale", action="store_true", help="skip the scale run")
    ap.add_argument("--scale-only", action="store_true", help="only the scale run")
    ap.add_argument("--no-failover", action="store_true", help="skip the failover run")
    ap.add_argument("--failover-nodes", type=int, metavar="N", help="only the failover of a standby on a cluster "
                    "of N nodes (bench/failover_scale.py; with --compare: the ref's operator too)")
    ap.add_argument("--reactions", type=int, default=5, help="scale-ups measured under load in the scale run")
    ap.add_argument("--compare", metavar="REF", help="git ref: its operator runs the scale run too, on the same "
                    "cluster, before this tree's (numbers prefixed base_)")
    ap.add_argument("--fresh", action="store_true", help="scale run: this tree's operator starts afresh after the "
                    "set-up, so its RSS and CPU are the bound cluster's steady state, not the set-up's")
    ap.add_argument("--operator-nice", type=int, default=0, metavar="N",
                    help="scale run: one more phase, this tree's operator afresh at niceness N (e.g. -10: the CPU "
                         "weight its pod's request gives it on a shared node; root only); its numbers get prefix nice_")
    ap.add_argument("--profile", action="store_true", help="sample the operator's main thread in the scale run "
                    "(bench/opsampler; writes bench/results/operator-profile-*.json)")
    a = ap.parse_args()
    if a.operator_nice > 0 or (a.operator_nice < 0 and os.geteuid() != 0):
        ap.error(f"--operator-nice {a.operator_nice}: a negative niceness (more CPU weight), and only as root")
    if a.scale:
        try:
            a.scale_nodes, a.scale_services = (int(x) for x in a.scale.split(","))
        except ValueError:
            ap.error(f"--scale {a.scale!r}: expected N,M (nodes,services), e.g. 2000,200")
    if a.failover_nodes:
        with tempfile.TemporaryDirectory(prefix="kascade-bench-failover-scale-") as tmp:
            res = run_failover_scale(Path(tmp), _stub_module(), TOKEN, a.failover_nodes,
                                     _unpack(a.compare, Path(tmp)) if a.compare else None)
        prev = REPO / "bench" / "results" / "operator.json"
        report("operator", {**(json.loads(prev.read_text()) if prev.exists() else {}), **res}, {})
        return
    scale_nodes, scale_services = (200, 20) if a.quick and not a.scale else (a.scale_nodes, a.scale_services)
    out: dict[str, float | str] = {} if a.scale_only else run(4 if a.quick else a.rounds, a.interval, a.rate_window)
    if not a.scale_only and not a.no_failover:
        out.update(run_failover())
        out.update(run_peering(3))  # the same 3 s with kopf's peering instead of the Lease: which is faster
    if not a.no_scale:
        with tempfile.TemporaryDirectory(prefix="kascade-bench-scale-") as tmp:
            base = None
            if a.compare:
                base = _unpack(a.compare, Path(tmp))
                out["scale_compare_ref"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.compare],
                                                          check=True, capture_output=True, text=True).stdout.strip()
            out.update(run_scale(Path(tmp), _stub_module(), TOKEN, scale_nodes, scale_services, a.scale_interval,
                                 a.steady or (10.0 if a.quick else 30.0), a.reactions, base, a.profile,
                                 a.fresh, a.operator_nice))
    if a.scale_only or a.no_scale:  # a partial run keeps the other part's numbers from the last run
        prev = REPO / "bench" / "results" / "operator.json"
        if prev.exists():
            kept = json.loads(prev.read_text())
            if a.scale_only:  # the scale part is measured anew: none of an earlier scale run's numbers (its
                # --compare side, a --fresh start-up, another size's) is reported as this run's
                kept = {k: v for k, v in kept.items() if not k.startswith(SCALE_KEYS)}
            out = {**kept, **out}
    # issue 33's bars: 300 ms at 2,000 nodes / 200 services; at 10,000 / 1,000 (KWOK) 1 s and RSS <= 1 GB
    fleet = scale_nodes >= 10000 and not a.no_scale
    report("operator", out, {"reaction_ms_p99": ("<=", 300.0), "scale_pods_created_beyond_need": ("<=", 0.0),
                             "scale_reaction_ms_p99": ("<=", 1000.0 if fleet else 300.0),
                             "reconcile_ms_p99": ("<=", 1000.0), "rounds_delivered_of_due": (">=", 0.95),
                             **({"operator_rss_mb": ("<=", 1024.0)} if fleet else {}),
                             **({"nice_scale_reaction_ms_p99": ("<=", 1000.0 if fleet else 300.0),
                                 "nice_rounds_delivered_of_due": (">=", 0.95)} if a.operator_nice else {})})


if __name__ == "__main__":
    main()
