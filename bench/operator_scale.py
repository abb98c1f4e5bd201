"""The operator at scale on the real API server: many fake GPU nodes and many ModelServices, each with a
bound replica whose engine is a loopback HTTP stand-in, the operator at its normal interval.

Measured: `scale_nodes`, `scale_modelservices`, with `--compare` the start-up of each operator started
afresh on the bound cluster (`operator_startup_first_round_s`: spawn -> its first round;
`operator_startup_all_rounds_s`: -> every service's first queued round), `operator_rss_mb` (VmRSS at the end) and
`operator_peak_rss_mb` (VmHWM), `reconcile_ms_p50/p90/p99` (from the operator's own histogram
kascade_operator_reconcile_seconds over the steady window: the upper bound of the bucket holding the
99th percentile), `rounds_delivered_of_due` (does it keep up? rounds started within one interval of being
due / rounds due: roundstats.py defines both), `rounds_per_service_per_s` (rounds are event-driven: an
idle service has one per resync period, so this is no longer a target), and scale-ups under that load
(`scale_reaction_ms`: the windowed metric crossing -> the target told to bind; each printed with its
path: crossing -> sweep wake -> round start -> decided -> plan created -> bind, roundstats.path).
Used by bench/reaction.py, which puts these beside the reaction numbers in bench/results/operator.json.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from roundstats import METRICS_TIMEOUT_S, delivered_of_due, lateness, path, settle, show
from stubhost import StubHost

from kascade_devcluster import nodes as devnodes
from kascade_devcluster.api import install_crds
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.ports import free_ports
from kascade_devcluster.waiting import Timeout, wait_for

NS = "scale"
NODE_LEASE_S = 1200  # KWOK's node Lease past 2,000 nodes (run_scale): 10,000 nodes -> 33 Lease writes/s, not 1,000
WAVE = 100  # services created per wave in the set-up; the next wave once this one is bound (set-up is not measured)
STUB_PROCS = 2  # processes the engine stand-ins run in (stubhost.py), apart from the bench's own
BUCKET = re.compile(r'^kascade_operator_reconcile_seconds_bucket\{le="([^"]+)",trigger="timer"\} (\S+)$')
COUNT = re.compile(r'^kascade_operator_reconcile_seconds_count\{trigger="timer"\} (\S+)$')
SWEEPS = re.compile(r'^kascade_operator_metric_sweep_seconds_count (\S+)$')
ANY_COUNT = re.compile(r'^kascade_operator_reconcile_seconds_count\{trigger="[^"]*"\} (\S+)$')


@dataclass(frozen=True)
class Phase:
    """One operator run of the scale bench: its numbers' key prefix, the tree it runs (None: this one; --compare)
    and its niceness (0, or --operator-nice's: the CPU weight its pod's request gives it)."""
    prefix: str
    src: Path | None
    nice: int = 0


def _rounds_so_far(port: int) -> tuple[float, float]:
    """(rounds of any trigger, queued rounds) the operator has counted; (0, 0) while /metrics is not up."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT_S).text
    except httpx.HTTPError:
        return 0.0, 0.0
    lines = text.splitlines()
    return (sum(float(m.group(1)) for ln in lines if (m := ANY_COUNT.match(ln))),
            sum(float(m.group(1)) for ln in lines if (m := COUNT.match(ln))))


def _startup(port: int, n_services: int, t_spawn: float) -> dict[str, float]:
    """Seconds from the operator's spawn to its first round, and to every service's first queued round."""
    first = wait_for(lambda: _rounds_so_far(port)[0] >= 1 and time.monotonic(), 900, "the first round", poll=0.2)
    wait_for(lambda: _rounds_so_far(port)[1] >= n_services, 900, "every service's first queued round", poll=0.2)
    out = {"operator_startup_first_round_s": round(first - t_spawn, 1),
           "operator_startup_all_rounds_s": round(time.monotonic() - t_spawn, 1)}
    print(f"scale: start-up {out}", flush=True)
    return out


def _histogram(port: int) -> tuple[dict[float, float], float, float]:
    """The reconcile histogram's buckets, its count, and the shared metric sweeps done (0: no sweep)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT_S).text
    buckets, count, sweeps = {}, 0.0, 0.0
    for line in text.splitlines():
        if m := BUCKET.match(line):
            buckets[float(m.group(1))] = float(m.group(2))
        elif m := COUNT.match(line):
            count = float(m.group(1))
        elif m := SWEEPS.match(line):
            sweeps = float(m.group(1))
    return buckets, count, sweeps


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the histogram bucket holding quantile `q` of the observations in between."""
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return float("nan")
    for le in sorted(delta):
        if delta[le] >= q * total:
            return le * 1000
    return float("inf")


def _rss_mb(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {
        k: float(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status.splitlines()) if k in ("VmRSS", "VmHWM")
    }
    return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024


SAMPLER = Path(__file__).resolve().parent / "opsampler"


def _operator_env(src: Path | None, sample_out: Path | None, gate: Path) -> dict[str, str]:
    """The operator's environment: another source tree's packages first (`src`, the baseline of a side-by-side
    run), and the sampling profiler (opsampler/sitecustomize.py) when `sample_out` is set."""
    path = os.environ.get("PYTHONPATH", "")
    if src is not None:
        path = ":".join(str(src / d) for d in ("planner", "cli", "operator", "engine", "sim", "e2e", "router")) \
            + ":" + path
    env = {"PYTHONPATH": path, "KASCADE_DEBUG_LOGGERS": "kascade_operator.trace"}  # roundstats.path reads it
    if sample_out is not None:
        env.update({"PYTHONPATH": f"{SAMPLER}:{path}", "KASCADE_SAMPLE_OUT": str(sample_out),
                    "KASCADE_SAMPLE_ON": str(gate)})
    return env


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def fleet(cp: ControlPlane, n_nodes: int) -> list[devnodes.NodeSpec]:
    """`n_nodes` KWOK GPU nodes (32 per leaf), created in a few big applies; returns once all are Ready."""
    specs = devnodes.topology_specs(n_nodes, 8, max(2, n_nodes // 32), prefix="scale-gpu")
    for i in range(0, len(specs), 500):
        doc = {"apiVersion": "v1", "kind": "List",
               "items": [devnodes.node_manifest(s, "scale") for s in specs[i:i + 500]]}
        cp.kubectl("create", "-f", "-", input=json.dumps(doc))

    def ready_nodes() -> bool:  # (kubectl wait on 2,000 nodes outlasts the tool timeout: poll instead)
        out = cp.kubectl(
            "get",
            "node",
            "-l",
            f"{devnodes.FAKE_SET_LABEL}=scale",
            "-o",
            'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\\n"}{end}',
        ).stdout
        print(f"scale: {out.split().count('True')}/{n_nodes} nodes Ready", flush=True)
        return out.split().count("True") >= n_nodes

    wait_for(ready_nodes, 900, f"{n_nodes} nodes Ready", poll=5.0)
    return specs


def run_scale(tmp: Path, stub_mod: Any, token: str, n_nodes: int, n_services: int, interval: float,
              steady_s: float, reactions: int = 5, compare: Path | None = None,
              profile: bool = False, fresh: bool = False, nice: int = 0) -> dict[str, float | str]:
    """Set up once (this tree's operator binds every service); then per operator (`compare`: a baseline source
    tree first, this tree's second), each started afresh on the bound cluster, a steady window and `reactions`
    scale-ups, each on another service. The baseline's numbers get the prefix base_. `fresh`: this tree's
    operator starts afresh after the set-up too (its RSS is then the steady state's, not the set-up's peak).
    `nice` (negative): one more phase, this tree's operator afresh at that niceness (prefix nice_): the CPU weight
    its pod's request gives it on a real node, where here it shares 2 cores with the API server, etcd, KWOK and
    every engine stand-in.
    KASCADE_BENCH_MEMTRACE=1: the set-up operator traces its memory (memtrace.py; dump kept with the logs)."""
    t0 = time.monotonic()
    # thousands of KWOK nodes on a loaded machine: KWOK's lease renewals lag, and with the default 40 s grace
    # the node controller marked nodes and their pods NotReady mid-run (no policy counts such a pod)
    # KWOK renews each node's Lease every quarter of its duration: at the kubelet's 40 s that is n_nodes / 10 s
    # Lease writes per second (1,000/s at 10,000 nodes) on the same 2 cores as the operator. The bench relaxes it
    # past 2,000 nodes and says so (what is emulated: nodes that exist and stay Ready, not their heartbeat load).
    lease_s = NODE_LEASE_S if n_nodes > 2000 else 40
    print(f"scale: emulated: {n_nodes} KWOK nodes (no kubelets), node Lease {lease_s} s (renewed every "
          f"{lease_s / 4:g} s: {n_nodes / (lease_s / 4):.0f} Lease writes/s), node status heartbeat every 10-20 min, "
          f"node grace 900 s; engines are HTTP stand-ins in {STUB_PROCS} processes", flush=True)
    cp = ControlPlane.create(tmp / "cp-scale").start(node_grace_s=900, node_lease_s=lease_s)
    op: OperatorProcess | None = None
    stubs: list[Any] = []
    phases = [Phase("base_", compare)] if compare is not None else []
    phases += [Phase("", None), *([Phase("nice_", None, nice)] if nice else [])]
    n_extra = 4 + reactions * len(phases)
    try:
        install_crds(cp)
        cp.kubectl("create", "namespace", NS)
        specs = fleet(cp, n_nodes)
        t_nodes = time.monotonic() - t0
        print(f"scale: {n_nodes} nodes Ready in {t_nodes:.0f} s", flush=True)
        pods = []
        data_ports = free_ports(n_services + n_extra)
        # one engine per service, plus idle ones for the scale-ups; in processes of their own (stubhost.py)
        host = StubHost(Path(stub_mod.__file__), [f"e{i}" for i in range(n_services + n_extra)], token, STUB_PROCS)
        stubs.extend(host.stubs)
        for i, s in enumerate(stubs):
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"e{i}", "labels": {"kascade.io/pool": "warm"},
                                      "annotations": {"kascade.io/endpoint": s.endpoint, "kascade.io/model": "tiny",
                                                      "kascade.io/data-endpoint": f"127.0.0.1:{data_ports[i]}"}},
                         "spec": {"nodeName": specs[i % len(specs)].name, "containers": [{"name": "e", "image": "x"}],
                                  "tolerations": [devnodes.KWOK_TOLERATION]}})
        for i in range(0, len(pods), 250):  # created (no last-applied copy) in parts: one apply of 1,024 pods outlasted
            # kubectl's 120 s on a loaded API server at 10,000 nodes
            cp.kubectl("-n", NS, "create", "-f", "-",
                       input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods[i:i + 250]}))
        (metrics_port,) = free_ports(1)
        gate = tmp / "sample-on"

        def start(ph: Phase) -> OperatorProcess:
            env = _operator_env(ph.src, tmp / f"profile-{ph.prefix or 'new_'}.json" if profile else None, gate)
            if ph.prefix == "setup_" and os.environ.get("KASCADE_BENCH_MEMTRACE") == "1":
                env["KASCADE_MEMTRACE_DUMP"] = str(tmp / "memtrace-setup.log")
            return OperatorProcess(cp, NS, token, tmp / f"operator-scale-{ph.prefix or 'new'}.log", interval=interval,
                                   extra_args=("--metrics-port", str(metrics_port), "--engine-image", "x",
                                               "--allowed-host-path-root", "/m"), env=env, nice=ph.nice).start()

        op = start(Phase("setup_", None))  # this tree's operator binds every service; each phase then starts afresh
        services = [{"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": f"svc{i}"},
                     "spec": {"model": {"name": "tiny", "source": {"path": "/m"}, "layers": 4},
                              "engine": {"image": "x"}, "replicas": {"colocated": {"min": 1, "max": 2}},
                              "scaling": {"policy": "threshold", "threshold": {"upper": 1000, "lower": 10}}}}
                    for i in range(n_services)]
        def bound_pods() -> list[dict[str, Any]]:
            out = cp.kubectl("-n", NS, "get", "pods", "-l", "kascade.io/model-service", "-o", "json").stdout
            items: list[dict[str, Any]] = json.loads(out)["items"]
            return items

        def progress(want: int) -> bool:
            loaded = [(p["metadata"].get("annotations") or {}).get("kascade.io/loaded") for p in bound_pods()]
            n = loaded.count("true")
            sick = unhealthy()
            assert op is not None and op.proc is not None
            print(f"scale: {n}/{want} services bound and loaded (operator RSS {_rss_mb(op.proc.pid)[0]:.0f} MB, "
                  f"load {os.getloadavg()[0]:.1f})"
                  + (f"; {len(sick)} pool pod(s) held out as unhealthy: {', '.join(sick[:5])}" if sick else ""),
                  flush=True)
            return n >= want

        def unhealthy() -> list[str]:
            """Pool pods a plan dropped as unhealthy (their stand-in missed the 5 s reachability window); the
            operator checks them again with a backoff (recovery.py) and heals those that answer."""
            items = json.loads(cp.kubectl("-n", NS, "get", "pods", "-o", "json").stdout)["items"]
            return sorted(f"{p['metadata']['name']} ({ann['kascade.io/unhealthy']})" for p in items
                          if "kascade.io/unhealthy" in (ann := p["metadata"].get("annotations") or {}))

        # in waves (WAVE services, each created in one call without a GET first; the next wave once this one is
        # bound): a burst of 1,000 services from nothing at 10,000 nodes had ~900 plan creates in flight at once
        # (3-20 s each) on 2 cores. The set-up is not what is measured: the steady window and reactions are.
        for i in range(0, n_services, WAVE):
            # 600 s: at 900 bound services on 10,000 nodes one create of 100 outlasted kubectl's usual 120 s
            cp.kubectl("-n", NS, "create", "-f", "-", timeout=600,
                       input=json.dumps({"apiVersion": "v1", "kind": "List", "items": services[i:i + WAVE]}))
            want = min(n_services, i + WAVE)
            wait_for(lambda w=want: progress(w), 900, f"{want} services serving", poll=5.0)
        t_ready = time.monotonic() - t0
        assert op.proc is not None
        setup_rss, setup_hwm = _rss_mb(op.proc.pid)
        print(f"scale: {n_services} services each bound and loaded after {t_ready:.0f} s; the set-up operator's "
              f"RSS {setup_rss:.0f} MB, peak {setup_hwm:.0f} MB", flush=True)
        out: dict[str, float | str] = {"scale_nodes": float(n_nodes), "scale_modelservices": float(n_services),
                                       "scale_setup_s": round(t_ready, 1), "scale_node_lease_s": float(lease_s),
                                       "scale_setup_operator_rss_mb": round(setup_rss, 1),
                                       "scale_setup_operator_peak_rss_mb": round(setup_hwm, 1),
                                       "scale_setup_unhealthy_at_end": float(len(unhealthy()))}
        for k, ph in enumerate(phases):
            if compare is not None or fresh or ph.nice:  # each operator starts afresh (kopf's start took minutes
                # at 2,000 nodes)
                if ph.nice:
                    print(f"scale: emulated: the operator at nice {ph.nice} (its CPU request's weight on a shared "
                          f"node); the API server, etcd, KWOK and the stand-ins at 0", flush=True)
                op.stop()
                t_spawn = time.monotonic()
                op = start(ph)
                out.update({ph.prefix + key: v for key, v in _startup(metrics_port, n_services, t_spawn).items()})
            out.update({ph.prefix + key: v for key, v in
                        _phase(op, metrics_port, stubs, bound_pods, n_services, interval, steady_s,
                               range(k * reactions, (k + 1) * reactions), gate).items()})
        # the pool (n_services + n_extra pods) covers every service: any fallback pod is one too many
        created = sum("kascade.io/created-for" in (p["metadata"].get("annotations") or {})
                      for p in json.loads(cp.kubectl("-n", NS, "get", "pods", "-o", "json").stdout)["items"])
        out["scale_pods_created_beyond_need"] = float(created)
        if profile:
            for ph in phases:
                f = tmp / f"profile-{ph.prefix or 'new_'}.json"
                if f.exists():
                    dest = Path(__file__).resolve().parent / "results" / f"operator-profile-{ph.prefix or 'new_'}.json"
                    dest.write_text(f.read_text())
                    print(f"scale: profile written to {dest}", flush=True)
        return out
    finally:
        if op is not None:
            op.stop()
        if keep := os.environ.get("KASCADE_BENCH_KEEP"):  # the operators' logs and profiles outlive the run
            Path(keep).mkdir(parents=True, exist_ok=True)
            for f in [*tmp.glob("*.log"), *tmp.glob("profile-*.json")]:  # (memtrace-setup.log too)
                (Path(keep) / f.name).write_bytes(f.read_bytes())
        for s in stubs:
            s.close()
        cp.stop()


def _phase(op: OperatorProcess, metrics_port: int, stubs: list[Any], bound_pods: Any, n_services: int,
           interval: float, steady_s: float, svcs: range, gate: Path) -> dict[str, float | str]:
    """One operator's steady window (rounds, CPU, RSS, reconcile quantiles) and its scale-ups under that load."""
    assert op.proc is not None
    settled = settle(metrics_port, interval)
    print(f"scale: operator settled (no round late over {2 * interval:g} s) after {settled:.1f} s", flush=True)
    gate.touch()
    before, c0, s0 = _histogram(metrics_port)
    late0, _ = lateness(metrics_port)
    w0, cpu0 = time.monotonic(), _cpu_s(op.proc.pid)
    load0 = os.getloadavg()[0]
    time.sleep(steady_s)
    after, c1, s1 = _histogram(metrics_port)
    late1, overdue = lateness(metrics_port)
    dt, cpu = time.monotonic() - w0, _cpu_s(op.proc.pid) - cpu0
    due = delivered_of_due(late0, late1, overdue, interval)
    print(f"scale: rounds due {due['rounds_due']:.0f}, delivered within {interval:g} s of due "
          f"{due['rounds_delivered']:.0f} ({due['rounds_delivered_of_due']}); {due}", flush=True)
    load1 = os.getloadavg()[0]
    rounds = (c1 - c0) / dt / n_services
    # every service's metrics read once per interval: by its own round (a timer per service), or by the
    # shared sweep that wakes a round only for services whose loads changed (event-driven rounds)
    evaluated = s1 - s0 if s1 > s0 else (c1 - c0) / n_services
    rss, hwm = _rss_mb(op.proc.pid)
    # scale-ups under that load: 5000 tok/s on one service's replica (upper 1000, window 1 s), one at a time
    pods = bound_pods()
    by_svc = {p["metadata"]["labels"]["kascade.io/model-service"]: p["metadata"]["name"] for p in pods}
    # a bound pod whose Ready condition is False (the node controller marks a node's pods NotReady when
    # KWOK misses the node's lease renewal on an overloaded machine) is not counted by any policy: a
    # scale-up cannot come from it. Counted and reported: reactions are only meaningful when this is 0.
    not_ready = sum(not any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in (p.get("status") or {}).get("conditions") or []) for p in pods)
    if not_ready:
        print(f"scale: {not_ready}/{len(pods)} bound pods not Ready (their nodes missed KWOK heartbeats)", flush=True)
    reactions: list[float] = []
    paths: list[dict[str, float]] = []
    for j in svcs:
        src = next(s for s in stubs if s.instance == by_svc[f"svc{j}"])
        t_load = time.monotonic()
        src.tokens_per_s = 5000.0
        def binds(t: float = t_load) -> list[float]:
            return [t2 for s in stubs for v, _, t2 in list(s.calls) if v == "bind" and t2 >= t]

        try:
            t_bind = wait_for(binds, 60, "the scale-up under load")[0]
            reactions.append((t_bind - (t_load + 1.0 * 1000 / 5000)) * 1000)
            time.sleep(0.3)  # the operator's log lines of this reaction are written
            steps = path(op.log, f"svc{j}", t_load + 1.0 * 1000 / 5000, t_bind)
            paths.append(steps)
            print(f"scale: svc{j} reaction {reactions[-1]:.0f} ms: {show(steps)}", flush=True)
        except Timeout:  # counted (p99 = inf), not fatal: the other operator's numbers still come out
            print(f"scale: svc{j} ({src.instance}) did not scale up within 60 s", flush=True)
            reactions.append(float("inf"))
        src.tokens_per_s = 0.0
        time.sleep(0.5)
    gate.unlink(missing_ok=True)
    print(f"scale: reactions {[f'{r:.0f}' for r in reactions]} ms", flush=True)
    return {"operator_settle_s": round(settled, 1),
            "operator_rss_mb": round(rss, 1), "operator_peak_rss_mb": round(hwm, 1),
            "reconcile_ms_p50": _quantile_ms(before, after, 0.5),
            "reconcile_ms_p90": _quantile_ms(before, after, 0.9),
            "reconcile_ms_p99": _quantile_ms(before, after, 0.99),
            "rounds_per_service_per_s": round(rounds, 3),
            **{k: v for k, v in due.items() if k.startswith("rounds_")},
            "metrics_evaluated_per_service_per_s": round(evaluated / dt, 3),
            "operator_cpu_s_per_s": round(cpu / dt, 3),
            "operator_cpu_ms_per_round": round(1000 * cpu / max(1.0, c1 - c0), 2),
            "operator_cpu_ms_per_service_per_s": round(1000 * cpu / dt / n_services, 3),
            "scale_loadavg_1m": round((load0 + load1) / 2, 1),
            "scale_reaction_ms": round(_percentile(reactions, 0.5), 1),
            "scale_reaction_ms_p50": round(_percentile(reactions, 0.5), 1),
            "scale_reaction_ms_p99": round(_percentile(reactions, 0.99), 1),
            "scale_reactions": float(len(reactions)), "scale_bound_pods_not_ready": float(not_ready),
            **{f"scale_path_{k}_ms_max": max(p[k] for p in paths if k in p)
               for k in ("wake", "start", "decided", "plan", "bind") if any(k in p for p in paths)}}
