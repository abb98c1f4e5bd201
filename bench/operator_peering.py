"""kopf peering failover, measured on the real API server beside the Lease election (issue 14, item 4).

The operator's HA is a Lease election (kascade_operator/leader.py). The issue asked which of the two
candidates fails over faster: the official client's Lease election or kopf's own peering. This module
measures the second one with kopf itself, so the two numbers come from the same control plane.

What runs: two processes of a minimal kopf operator (`--probe`, this file) with peering on (a
namespaced `KopfPeering` object, the CRD written below), priority 100 (the leader) and 50 (the
standby), `settings.peering.lifetime = L`. The probe's only handler logs "<who> handled <name> <unix
time>" for each ConfigMap created in its namespace. The leader handles a ConfigMap; it is SIGKILLed; a
second ConfigMap is created at the same moment; failover = kill -> the standby's handler for it. That
is kopf's mechanism alone (no Kascade reconcile), so it is a lower bound on an operator built on it.

A second scenario starts two probes with the SAME priority, as a Deployment's replicas would be (one pod
template, one priority): kopf pauses every operator ("Possibly conflicting operators with the same
priority") and nothing is handled; the result records whether anything was handled within 15 s.

Data flow: ControlPlane -> KopfPeering CRD + object -> 2 probe processes -> ConfigMaps -> probe logs ->
{"failover_kopf_peering_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {"group": "kopf.dev", "scope": "Namespaced",
             "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {
                               "type": "object",
                               "properties": {"status": {"type": "object",
                                                         "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}
HANDLED = re.compile(r"(\w+) handled (\S+) ([0-9.]+)")


def _probe(who: str, ns: str, priority: int, lifetime: int) -> None:
    """A minimal kopf operator with peering on: logs each ConfigMap it handles."""
    import logging

    import kopf

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.peering.lifetime = lifetime
        settings.posting.enabled = False
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="probe.kascade.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="probe.kascade.io")

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.create("configmaps", registry=registry)
    def handled(name: str, **_: Any) -> None:
        print(f"{who} handled {name} {time.time():.3f}", flush=True)

    kopf.run(registry=registry, standalone=False, priority=priority, peering_name="kascade", namespaces=[ns],
             identity=who)  # type: ignore[arg-type]


class _Probe:
    def __init__(self, cp: Any, who: str, ns: str, priority: int, lifetime: int, log: Path) -> None:
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig)}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--probe", who, "--namespace", ns, "--priority", str(priority),
             "--lifetime", str(lifetime)], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def handled(self) -> dict[str, float]:
        return {m.group(2): float(m.group(3)) for m in HANDLED.finditer(self.log.read_text())}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def _peers(cp: Any, ns: str) -> dict[str, Any]:
    got = cp.kubectl("-n", ns, "get", "kopfpeering", "kascade", "-o", "json").stdout
    return dict(json.loads(got).get("status") or {})


def _configmap(cp: Any, ns: str, name: str) -> None:
    cp.kubectl("-n", ns, "create", "configmap", name)


def run_peering(lifetime: int = 3) -> dict[str, float | str]:
    """Leader SIGKILL -> the standby handling an object created at the kill, with kopf peering."""
    from kascade_devcluster.controlplane import ControlPlane
    from kascade_devcluster.waiting import wait_for

    with tempfile.TemporaryDirectory(prefix="kascade-bench-peering-") as tmp:
        cp = ControlPlane.create(Path(tmp) / "cp").start(scheduling=False, kwok=False)
        probes: list[_Probe] = []
        try:
            cp.kubectl("apply", "-f", "-", input=json.dumps(PEERING_CRD))
            cp.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev", "--timeout=60s")
            out: dict[str, float | str] = {"failover_kopf_peering_lifetime_s": float(lifetime)}
            for ns in ("peer-ha", "peer-same"):
                cp.kubectl("create", "namespace", ns)
                cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(
                    {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "kascade"}}))
            # 1. leader (100) and standby (50)
            a = _Probe(cp, "a", "peer-ha", 100, lifetime, Path(tmp) / "a.log")
            probes.append(a)
            _configmap(cp, "peer-ha", "warmup")
            wait_for(lambda: "warmup" in a.handled(), 60, "handling by the leader")
            b = _Probe(cp, "b", "peer-ha", 50, lifetime, Path(tmp) / "b.log")
            probes.append(b)
            wait_for(lambda: {"a", "b"} <= set(_peers(cp, "peer-ha")), 60, "both peers in the KopfPeering")
            _configmap(cp, "peer-ha", "before")
            wait_for(lambda: "before" in a.handled(), 30, "the leader handling 'before'")
            time.sleep(lifetime / 2)  # the kill lands mid-way between two keep-alives, on average
            a.proc.send_signal(signal.SIGKILL)
            t_kill = time.time()
            _configmap(cp, "peer-ha", "after")
            t_handled = wait_for(lambda: b.handled().get("after"), 4 * lifetime + 60, "the standby's takeover")
            out["failover_kopf_peering_s"] = round(t_handled - t_kill, 3)
            out["kopf_peering_standby_handled_before"] = float("before" in b.handled())
            print(f"kopf peering failover: {t_handled - t_kill:.2f} s (lifetime {lifetime} s)", flush=True)
            # 2. same priority: the replicas of one Deployment
            for p in probes:
                p.stop()
            c = _Probe(cp, "c", "peer-same", 0, lifetime, Path(tmp) / "c.log")
            d = _Probe(cp, "d", "peer-same", 0, lifetime, Path(tmp) / "d.log")
            probes += [c, d]
            wait_for(lambda: {"c", "d"} <= set(_peers(cp, "peer-same")), 60, "both same-priority peers")
            time.sleep(2 * lifetime)
            _configmap(cp, "peer-same", "same")
            time.sleep(15)
            handled = "same" in c.handled() or "same" in d.handled()
            out["kopf_peering_same_priority_handled_within_15s"] = float(handled)
            out["kopf_peering_note"] = ("kopf 1.45 peering: kill -> the standby's handler (kopf alone, no reconcile); "
                                        "two replicas with one priority (one Deployment template) "
                                        + ("still handled" if handled else "both paused: nothing handled"))
            print(out["kopf_peering_note"], flush=True)
            return out
        except Exception:
            for p in probes:  # the probes' own words say why
                print(f"--- {p.log.name}:\n{p.log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            for p in probes:
                p.stop()
            cp.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", metavar="WHO", help=argparse.SUPPRESS)
    ap.add_argument("--namespace", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--priority", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=int, default=3, help="kopf peering lifetime in whole seconds (kopf's unit)")
    a = ap.parse_args()
    if a.lifetime < 1:
        ap.error(f"--lifetime {a.lifetime}: must be >= 1 (kopf's unit is whole seconds)")
    if a.probe:
        _probe(a.probe, a.namespace, a.priority, a.lifetime)
        return
    print(json.dumps(run_peering(a.lifetime), indent=1))


if __name__ == "__main__":
    main()
