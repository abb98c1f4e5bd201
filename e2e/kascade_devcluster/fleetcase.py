"""The fleet e2e's parts (issue 35): one warm pool of REAL engine processes shared by several ModelServices,
the operator and the router as real processes, and the reads the fleet tests make of the control plane.

Data flow: `FleetCase.start(nodes, started_for)` -> an `EnginePool` of `kascade engine serve --empty` processes
started for one model (one per KWOK node) -> the operator process (arbitration hysteresis `hysteresis_s`) ->
the router process; `stop()` ends them in reverse and returns the operator log's tail. `msvc()` writes a
ModelService with the threshold policy on tokens/s; `serving()` reads which pods serve a service (loaded, not
draining); `plans_for()` the ScalePlans of a service that bound given pods, with the decision -> serving time
each took (creation -> completion, 1 s resolution of the API's timestamps) and the plan's own duration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.routerproc import RouterProcess

TOKEN = "e2e-fleet-token"


@dataclass
class FleetCase:
    cp: ControlPlane
    ns: str
    ckpts: dict[str, Path]
    log_dir: Path
    hysteresis_s: float = 3.0
    engine_args: tuple[str, ...] = ("--kv-tokens", "4096")
    pool: EnginePool | None = None
    _procs: list[Any] = field(default_factory=list)

    def start(self, nodes: list[str], started_for: str) -> tuple[EnginePool, RouterProcess]:
        """One engine per node, started (empty) for `started_for`; then the operator and the router."""
        self.pool = EnginePool(self.cp, self.ns, self.ckpts[started_for], started_for, TOKEN,
                               self.log_dir / "engines", extra_args=self.engine_args)
        self.pool.start(nodes)
        op = OperatorProcess(self.cp, self.ns, TOKEN, self.log_dir / "operator.log",
                             env={"KASCADE_OPERATOR_ARBITRATION_HYSTERESIS_SECONDS": str(self.hysteresis_s)})
        self._procs.append(op)
        op.start()
        router = RouterProcess(self.cp, self.ns, self.log_dir / "router.log")
        self._procs.append(router)
        router.start()
        return self.pool, router

    def stop(self) -> str:
        """Router, operator, engines; the operator log's tail ('' when it never started)."""
        tail = ""
        for p in reversed(self._procs):
            p.stop()
            if isinstance(p, OperatorProcess):
                tail = p.tail()
        if self.pool is not None:
            self.pool.stop()
        return tail

    def apply(self, doc: dict[str, Any]) -> None:
        self.cp.kubectl("-n", self.ns, "apply", "-f", "-", input=json.dumps(doc))

    def get(self, *what: str) -> Any:
        return get(self.cp, self.ns, *what)

    def serving(self, svc: str) -> list[str]:
        return serving(self.cp, self.ns, svc)

    def arbitration(self, svc: str) -> dict[str, Any] | None:
        return (self.get("msvc", svc).get("status") or {}).get("arbitration")

    def events(self, svc: str) -> list[dict[str, Any]]:
        return [e for e in self.get("events")["items"] if e["involvedObject"].get("name") == svc]

    def plans_for(self, svc: str, pods: set[str]) -> list[dict[str, Any]]:
        """The ScalePlans of `svc` whose targets include one of `pods`."""
        return [p for p in self.get("splan")["items"] if p["spec"]["modelServiceRef"]["name"] == svc
                and {t["pod"] for t in p["spec"]["targets"]} & pods]


def msvc(name: str, ckpt: Path, lo: int, hi: int, priority: int, delay_s: float, upper: float = 60,
         lower: float = 20) -> dict[str, Any]:
    """A colocated ModelService of the local checkpoint `ckpt`: threshold policy on tokens/s per replica."""
    return {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": name},
            "spec": {"model": {"name": name, "source": {"path": str(ckpt)}}, "engine": {"image": "kascade:dev"},
                     "replicas": {"colocated": {"min": lo, "max": hi}},
                     "scaling": {"policy": "threshold", "intervalSeconds": 0.2, "scaleDownDelaySeconds": delay_s,
                                 "priority": priority,
                                 "threshold": {"metric": "tokensPerSecond", "upper": upper, "lower": lower}}}}


def get(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def serving(cp: ControlPlane, ns: str, svc: str) -> list[str]:
    """Pods of `svc` whose engine reported the model loaded and that are not draining, by name."""
    return sorted(p["metadata"]["name"] for p in get(cp, ns, "pods", "-l", f"kascade.io/model-service={svc}")["items"]
                  if p["metadata"]["annotations"].get("kascade.io/loaded") == "true"
                  and "kascade.io/draining" not in p["metadata"]["annotations"])


def ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def switch_seconds(plans: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per plan (decision -> serving: creation -> completion, the plan's own durationSeconds)."""
    return [(ts(p["status"]["completionTime"]) - ts(p["metadata"]["creationTimestamp"]),
             float(p["status"].get("durationSeconds") or 0)) for p in plans]
