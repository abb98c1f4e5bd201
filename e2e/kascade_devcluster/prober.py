"""The kubelet's readinessProbe for engine pods that KWOK fakes: KWOK marks every pod Ready and runs
nothing, so this thread does what a kubelet does with the pool pods' probe (`GET /readyz` on the
engine, period `period_s`, one failure flips it) and writes the pod's Ready condition through the API.
Like a kubelet it folds the pod's readiness gates into Ready: ContainersReady is the probe alone,
Ready is the probe AND every condition the pod's `spec.readinessGates` name being True (the operator
writes `kascade.io/serving`). Routers, Services and the operator then see exactly what they would see
in a real cluster.

Data flow: engine name -> HTTP address (EnginePool) -> GET /readyz every period, plus one LIST of the
namespace's pods for their gates -> on a change, a strategic-merge patch of pods/<name>/status
(conditions merge by type).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from kascade_devcluster.controlplane import ControlPlane

log = logging.getLogger(__name__)


class ReadinessProber:
    def __init__(self, cp: ControlPlane, namespace: str, targets: Callable[[], dict[str, str]],
                 period_s: float = 0.2) -> None:
        self.cp, self.ns, self.targets, self.period_s = cp, namespace, targets, period_s
        self.state: dict[str, tuple[tuple[bool, bool], float]] = {}  # pod -> ((Ready, ContainersReady) written, when)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ReadinessProber:
        self._thread = threading.Thread(target=self._run, name="readiness-prober", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        api = httpx.Client(base_url=self.cp.api_url, verify=str(self.cp.ca_cert), timeout=5.0,
                           headers={"Authorization": f"Bearer {self.cp.token}"})
        probe = httpx.Client(timeout=max(self.period_s, 0.5))
        try:
            while not self._stop.is_set():
                targets = self.targets()
                gates = self._gates(api) if targets else {}
                for pod, addr in targets.items():
                    try:
                        probed = probe.get(f"http://{addr}/readyz").status_code == 200
                    except httpx.HTTPError:
                        probed = False  # a dead engine is not Ready
                    ok = (probed and gates.get(pod, True), probed)
                    last = self.state.get(pod)
                    now = time.monotonic()
                    # written again now and then: KWOK sets its own status when it first sees a pod
                    if last is not None and last[0] == ok and now - last[1] < 1.0:
                        continue
                    try:
                        self._patch(api, pod, ok, last is None or last[0] != ok)
                        self.state[pod] = (ok, now)
                    except httpx.HTTPError as e:
                        log.warning("readiness of %s not written: %s", pod, e)
                self._stop.wait(self.period_s)
        finally:
            api.close()
            probe.close()

    def _gates(self, api: httpx.Client) -> dict[str, bool]:
        """pod -> are all the conditions its readinessGates name True (a pod without gates: True). A failed
        read counts every gate as closed for this period (a kubelet that cannot tell keeps the pod out)."""
        try:
            r = api.get(f"/api/v1/namespaces/{self.ns}/pods")
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("pods of %s not read for their readiness gates: %s", self.ns, e)
            return {pod: False for pod in self.targets()}
        return {str(p["metadata"]["name"]): gates_open(p) for p in r.json().get("items") or []}

    def _patch(self, api: httpx.Client, pod: str, ok: tuple[bool, bool], changed: bool) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        conds = [{"type": t, "status": "True" if v else "False", "lastTransitionTime": now}
                 for t, v in zip(("Ready", "ContainersReady"), ok, strict=True)]
        r = api.patch(f"/api/v1/namespaces/{self.ns}/pods/{pod}/status", json={"status": {"conditions": conds}},
                      headers={"Content-Type": "application/strategic-merge-patch+json"})
        if r.status_code == 404:
            return
        r.raise_for_status()
        if changed:
            log.info("pod %s Ready=%s (engine /readyz %s, readiness gates %s)", pod, ok[0],
                     "ok" if ok[1] else "failing", "open" if ok[0] or not ok[1] else "closed")


def gates_open(pod: dict[str, Any]) -> bool:
    """What a kubelet folds into Ready beside the probes: every condition named by spec.readinessGates is
    True (a gate whose condition was never written is closed)."""
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return all(conds.get(g.get("conditionType")) == "True" for g in (pod.get("spec") or {}).get("readinessGates") or [])
