"""The chart's Argo CD health checks (Lua, charts/kascade/argocd/) run in a real Lua interpreter (lupa)
against statuses the operator's status module produces, and agree with the kstatus reading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from builders import pod, spec

from kascade_operator.reconcile import reconcile
from kascade_operator.status import Blocker, invalid_status, kstatus, plan_conditions, service_status

lupa = pytest.importorskip("lupa", reason="lupa (dev extra) runs the Lua health checks")
ARGO = Path(__file__).resolve().parents[2] / "charts" / "kascade" / "argocd"


def health(script: str, obj: dict[str, Any]) -> tuple[str, str]:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v: Any) -> Any:
        if isinstance(v, dict):
            return lua.table_from({k: to_lua(x) for k, x in v.items()})
        if isinstance(v, list):
            return lua.table_from([to_lua(x) for x in v])
        return v

    fn = lua.eval("function(obj) " + (ARGO / script).read_text() + " end")
    hs = fn(to_lua(obj))
    return str(hs["status"]), str(hs["message"])


def msvc(st: dict[str, Any] | None, gen: int = 2) -> dict[str, Any]:
    return {"metadata": {"name": "svc", "generation": gen}, **({"status": st} if st is not None else {})}


READY = [pod("r", "n0", "svc", "colocated", ready=True)]


@pytest.mark.parametrize(("case", "obj", "status", "kstat"), [
    ("no status yet", msvc(None), "Progressing", "InProgress"),
    ("ready", msvc(service_status("svc", "svc", reconcile("svc", spec(lo=1), READY, []), READY, [], 2)),
     "Healthy", "Current"),
    ("stale status", msvc(service_status("svc", "svc", reconcile("svc", spec(lo=1), READY, []), READY, [], 1)),
     "Progressing", "InProgress"),
    ("pool short", msvc(service_status("svc", "svc", reconcile("svc", spec(lo=2), READY, []), READY, [], 2)),
     "Progressing", "InProgress"),
    ("exhausted", msvc(service_status("svc", "svc", reconcile(
        "svc", spec(lo=2), [*READY, pod("f", None, created_for="svc", unschedulable=True)], []), READY, [], 2)),
     "Degraded", "Failed"),
    ("forbidden", msvc(service_status("svc", "svc", reconcile("svc", spec(lo=2), READY, []), READY, [], 2,
                                      Blocker("Forbidden", "spec.engine.image: not allowed"))), "Degraded", "Failed"),
    ("invalid", msvc(invalid_status("spec.engine.tp: 64 exceeds", 2)), "Degraded", "Failed"),
])
def test_modelservice_health_matches_kstatus(case: str, obj: dict[str, Any], status: str, kstat: str) -> None:
    got, message = health("modelservice-health.lua", obj)
    assert (got, kstatus(obj)) == (status, kstat), case
    if status == "Degraded":
        assert "spec." in message or "PoolExhausted" in message


@pytest.mark.parametrize(("phase", "status"), [("Transferring", "Progressing"), ("Succeeded", "Healthy"),
                                               ("Failed", "Degraded")])
def test_scaleplan_health(phase: str, status: str) -> None:
    obj = {"metadata": {"generation": 1}, "status": {"phase": phase, "conditions": plan_conditions(phase, "", 1)}}
    assert health("scaleplan-health.lua", obj)[0] == status
