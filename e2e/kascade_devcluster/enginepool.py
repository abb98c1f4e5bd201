"""A warm pool of REAL engine processes behind KWOK pods: what a GPU node's kubelet would run, here on
loopback.

KWOK pods run nothing, so each pool pod is backed by a local `kascade engine serve --empty` process
(the model's config and tokenizer only; weights arrive by `bind` with a source path or by a load
plan). The pod carries the engine's addresses as the annotations the operator honours
(`kascade.io/endpoint` for the control/HTTP API, `kascade.io/data-endpoint` for the weight data
plane, `kascade.io/act-endpoint` where it finishes split requests of a live-paired loading engine)
and the label `kascade.io/pool=warm`.

Data flow: `EnginePool.start(nodes)` -> one engine process per node (own session, dies with this
interpreter, log under `log_dir`) -> its `KASCADE_ENGINE_READY http=<port>` line -> a pool pod pinned
to the node (`spec.nodeName`) with the annotations -> the operator binds and instructs the engine.
A `ReadinessProber` plays the kubelet's readinessProbe (GET /readyz -> the pod's Ready condition);
the pods declare the operator's readiness gate `kascade.io/serving`, as the chart's pool pods do.
`kill(name)` SIGKILLs one engine (fault tests); `stop()` ends them all and deletes their pods.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kascade_devcluster import processes
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.ports import free_port_runs, free_ports
from kascade_devcluster.prober import ReadinessProber

log = logging.getLogger(__name__)

READY = re.compile(r"KASCADE_ENGINE_READY http=(\d+)")
POOL_LABEL, ENDPOINT, DATA_ENDPOINT = "kascade.io/pool", "kascade.io/endpoint", "kascade.io/data-endpoint"
ACT_ENDPOINT = "kascade.io/act-endpoint"
ENGINE_TP = "kascade.io/engine-tp"  # kascade_operator.labels.ENGINE_TP
SERVING_GATE = "kascade.io/serving"  # kascade_operator.labels.SERVING_GATE (the harness imports no operator code)


@dataclass
class PoolEngine:
    name: str  # pod name, also the engine's instance id
    node: str
    proc: processes.Proc
    http_port: int
    data_port: int
    act_port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"


class EnginePool:
    def __init__(self, cp: ControlPlane, namespace: str, checkpoint: Path, model_name: str, token: str,
                 log_dir: Path, extra_args: tuple[str, ...] = (), readiness_gate: bool = True, tp: int = 1) -> None:
        if not (checkpoint / "config.json").is_file():
            raise ValueError(f"checkpoint {checkpoint}: no config.json")
        self.cp, self.ns, self.checkpoint, self.model, self.token = cp, namespace, checkpoint, model_name, token
        self.log_dir, self.extra_args = log_dir, extra_args
        self.tp = tp  # engines run `--tp tp` ranks: rank r listens on data_port + r; pods say kascade.io/engine-tp
        self.readiness_gate = readiness_gate  # the pods declare kascade.io/serving, as the chart's pool pods do
        self.engines: dict[str, PoolEngine] = {}
        # what a kubelet does with the pool pods' readinessProbe (GET /readyz), which KWOK does not run
        self.prober = ReadinessProber(cp, namespace, lambda: {n: e.endpoint for n, e in list(self.engines.items())})

    def start(self, nodes: list[str], prefix: str = "engine", timeout: float = 120.0) -> list[PoolEngine]:
        """Start one engine per node (in parallel), then create their pool pods."""
        first = len(self.engines)
        started = []
        ports = free_ports(2 * len(nodes))
        if self.tp > 1:  # data ports with room for every rank's
            runs = free_port_runs(len(nodes), self.tp)
            ports = [p for k in range(len(nodes)) for p in (ports[2 * k], runs[k])]
        for i, node in enumerate(nodes, start=first):
            name = f"{prefix}-{i}"
            argv = [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--checkpoint", str(self.checkpoint),
                    "--model-name", self.model, "--empty", "--port", "0", "--act-port", str(ports[2 * (i - first)]),
                    *(["--tp", str(self.tp)] if self.tp > 1 else []), *self.extra_args]
            proc = processes.start(name, argv, self.log_dir, env={"KASCADE_ENGINE_TOKEN": self.token},
                                   die_with_parent=True)
            started.append((name, node, proc))
        out = []
        for k, (name, node, proc) in enumerate(started):
            e = PoolEngine(name, node, proc, self._wait_ready(proc, timeout), ports[2 * k + 1], ports[2 * k])
            self.engines[name] = e
            self._create_pod(e)
            out.append(e)
        if not self.prober.running:
            self.prober.start()
        log.info("warm pool: %d engine processes for %s on %d nodes", len(out), self.model, len(set(nodes)))
        return out

    def _wait_ready(self, proc: processes.Proc, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY.search(proc.log.read_text(errors="replace")) if proc.log.exists() else None
            if m:
                return int(m.group(1))
            if not processes.alive(proc.pid):
                raise RuntimeError(f"engine {proc.name} exited before it was ready; log {proc.log}:\n"
                                   f"{processes.tail(proc.log)}")
            time.sleep(0.1)
        raise RuntimeError(f"engine {proc.name} not ready after {timeout:.0f} s (log {proc.log})")

    def _create_pod(self, e: PoolEngine) -> None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": e.name,
                "labels": {POOL_LABEL: "warm", "app.kubernetes.io/name": "kascade-engine"},
                "annotations": {
                    ENDPOINT: e.endpoint,
                    DATA_ENDPOINT: f"127.0.0.1:{e.data_port}",
                    ACT_ENDPOINT: f"127.0.0.1:{e.act_port}",
                    **({ENGINE_TP: str(self.tp)} if self.tp > 1 else {}),
                },
            },
            "spec": {
                "nodeName": e.node,
                # as the chart's pool pods: Ready also needs the operator's serving gate (the
                # ReadinessProber folds it in like a kubelet)
                **({"readinessGates": [{"conditionType": SERVING_GATE}]} if self.readiness_gate else {}),
                "containers": [
                    {
                        "name": "engine",
                        "image": "kascade:dev",
                        "resources": {"limits": {"nvidia.com/gpu": str(self.tp)}},
                        # named like the chart's pool pods (the PodMonitor keeps port http);
                        # the endpoint annotation still says where the process listens
                        "ports": [{"name": "http", "containerPort": int(e.endpoint.rsplit(":", 1)[1])}],
                    }
                ],
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
        self.cp.kubectl("-n", self.ns, "apply", "-f", "-", input=json.dumps(pod))

    def kill(self, name: str) -> None:
        """SIGKILL one engine process (its pod stays: the operator must notice the engine is gone)."""
        e = self.engines[name]
        if processes.alive(e.proc.pid, e.proc.started):
            os.killpg(e.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while processes.alive(e.proc.pid, e.proc.started) and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self, delete_pods: bool = True) -> None:
        self.prober.stop()
        for e in self.engines.values():
            processes.stop(e.proc.pid, started=e.proc.started)
        if delete_pods and self.engines:
            self.cp.kubectl(
                "-n", self.ns, "delete", "pod", "--wait=false", "--ignore-not-found", *self.engines, check=False
            )
        self.engines.clear()
