"""Failover of a standby operator on a big cluster: how long from the leader's SIGKILL to the standby's first
bind when thousands of nodes exist (a standby starts kopf only once it leads, so its start-up is part of the
failover).

Set-up: one local control plane with `n_nodes` KWOK GPU nodes (operator_scale.fleet). Per operator tree
(`compare`: a baseline source tree first, prefix base_; then this tree), in a namespace of its own: three
warm-pool pods with loopback engine stand-ins, two replicas with leader election on a Lease (3 s lease),
a ModelService at min 1 bound by the leader; then the leader is SIGKILLed and a scale-up asked at the same
moment. `failover_scale_s`: kill -> the standby's first `bind` call of a target of a ScalePlan created after
the kill (binds of the dead leader's plans never count); `failover_scale_leader_start_s`: the
first replica's spawn -> its first bind (a cold start at that size).
Used by bench/reaction.py (`--failover-nodes N`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from operator_scale import _operator_env, fleet

from kascade_devcluster import nodes as devnodes
from kascade_devcluster.api import install_crds
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for

WAIT_S = 900.0  # a baseline's kopf start took minutes at 2,000 nodes


def run_failover_scale(tmp: Path, stub_mod: Any, token: str, n_nodes: int, compare: Path | None = None,
                       lease_s: float = 3.0) -> dict[str, float | str]:
    cp = ControlPlane.create(tmp / "cp-failover").start()
    try:
        install_crds(cp)
        specs = fleet(cp, n_nodes)
        out: dict[str, float | str] = {"failover_scale_nodes": float(n_nodes), "failover_scale_lease_s": lease_s}
        phases = ([("base_", compare)] if compare is not None else []) + [("", None)]
        for prefix, src in phases:
            got = _one(cp, tmp, stub_mod, token, f"fo-{prefix.rstrip('_') or 'new'}", src, specs, lease_s)
            out.update({prefix + k: v for k, v in got.items()})
        return out
    finally:
        cp.stop()


def _one(cp: ControlPlane, tmp: Path, stub_mod: Any, token: str, ns: str, src: Path | None,
         specs: list[devnodes.NodeSpec], lease_s: float) -> dict[str, float]:
    ops: list[OperatorProcess] = []
    stubs: list[Any] = []
    try:
        cp.kubectl("create", "namespace", ns)
        for i in range(3):
            s = stub_mod.EngineStub(f"{ns}-{i}", "tiny", token)
            stubs.append(s)
            cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(
                {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": f"f{i}", "labels": {"kascade.io/pool": "warm"},
                              "annotations": {"kascade.io/endpoint": s.endpoint, "kascade.io/model": "tiny"}},
                 "spec": {"nodeName": specs[i].name, "containers": [{"name": "e", "image": "x"}],
                          "tolerations": [devnodes.KWOK_TOLERATION]}}))
        ha = ("--leader-elect", "--lease-namespace", ns, "--lease-duration", str(lease_s),
              "--lease-renew-deadline", str(lease_s * 2 / 3), "--lease-retry", "1")
        doc = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "svc"},
               "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4},
                        "engine": {"image": "x"}, "replicas": {"colocated": {"min": 1, "max": 3}}}}
        cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))
        t_spawn = time.monotonic()
        for who in ("a", "b"):
            ops.append(OperatorProcess(cp, ns, token, tmp / f"{ns}-{who}.log", interval=0.1,
                                       extra_args=(*ha, "--identity", who), env=_operator_env(src, None, tmp)).start())
            if who == "a":
                wait_for(lambda: "a leads" in ops[0].tail(), 60, f"{ns}: a leads")
        wait_for(lambda: "b: standby" in ops[1].tail(), 60, f"{ns}: b waits")
        t_first = wait_for(lambda: [t for s in stubs for v, _, t in list(s.calls) if v == "bind"], WAIT_S,
                           f"{ns}: min bound by the leader")[0]
        print(f"failover-scale {ns}: the leader's first bind {t_first - t_spawn:.1f} s after its spawn", flush=True)
        time.sleep(1.0)
        before = plan_names(cp, ns)  # the leader's plans: their binds never count
        ops[0].kill()
        t_kill = time.monotonic()
        cp.kubectl("-n", ns, "scale", "msvc", "svc", "--replicas=2")
        t_bind = wait_for(standby_binds(cp, ns, {f"f{i}": s for i, s in enumerate(stubs)}, before, t_kill), WAIT_S,
                          f"{ns}: the standby's bind", poll=0.25)[0]
        print(f"failover-scale {ns}: {t_bind - t_kill:.2f} s at {len(specs)} nodes (lease {lease_s:g} s)", flush=True)
        return {"failover_scale_s": round(t_bind - t_kill, 2),
                "failover_scale_leader_start_s": round(t_first - t_spawn, 1)}
    finally:
        for o in ops:
            o.stop()
        if keep := os.environ.get("KASCADE_BENCH_KEEP"):  # the replicas' logs outlive the run
            Path(keep).mkdir(parents=True, exist_ok=True)
            for o in ops:
                (Path(keep) / o.log.name).write_bytes(o.log.read_bytes())
        for s in stubs:
            s.close()


def _plans(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cp.kubectl("-n", ns, "get", "scaleplans", "-o", "json").stdout)["items"]
    return items


def plan_names(cp: ControlPlane, ns: str) -> set[str]:
    return {str(p["metadata"]["name"]) for p in _plans(cp, ns)}


def standby_binds(cp: ControlPlane, ns: str, by_pod: dict[str, Any], before: set[str],
                  t_kill: float) -> Callable[[], list[float]]:
    """A wait_for predicate: the times of binds, after the kill, of targets of ScalePlans created after it
    (`before`: the plans that existed at the kill). A bind the killed leader sent before it died but the
    stand-in answered after the kill once counted as a failover of 0.63 s, less than the 3 s lease."""

    def binds() -> list[float]:
        targets = {t.get("pod") or t["instance"] for p in _plans(cp, ns) if p["metadata"]["name"] not in before
                   for t in (p.get("spec") or {}).get("targets") or []}
        return sorted(t for pod in targets if pod in by_pod for v, _, t in list(by_pod[pod].calls)
                      if v == "bind" and t > t_kill)

    return binds
