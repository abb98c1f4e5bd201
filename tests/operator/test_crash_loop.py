"""An engine that exits as it starts (a flag it refuses, e.g. a `tp` that does not divide the model's heads, which
the operator cannot check: it never reads the model's config) shows in the ModelService's conditions, naming the
pod, the engine's last words and the spec field they name (issue 34 item 3).

The engine's containers keep the tail of its output as their termination message
(`terminationMessagePolicy: FallbackToLogsOnError`); a container in CrashLoopBackOff is what `pod_view` reports
(`PodView.crashed`); `service_status` makes it Stalled (EngineCrashLoop) when nothing serves, else Degraded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from builders import pod, spec

from kascade_operator.podtemplate import fallback_pod
from kascade_operator.pool import pod_view
from kascade_operator.reconcile import reconcile
from kascade_operator.status import kstatus, service_status

REFUSED = ("Usage: python -m kascade_cli.main engine serve [OPTIONS]\nTry '... --help' for help.\n\n"
           "Error: --checkpoint /models/smollm: tp: 2 does not divide num_attention_heads (9)\n")


def _raw(waiting: str | None, restarts: int, message: str = REFUSED, code: int = 2) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "engine", "restartCount": restarts, "ready": False, "started": False,
                          "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}}}
    if restarts:
        cs["lastState"] = {"terminated": {"exitCode": code, "reason": "Error", "message": message}}
    return {"metadata": {"name": "svc-fb-1", "labels": {"kascade.io/pool": "warm"},
                         "annotations": {"kascade.io/created-for": "svc"}},
            "status": {"phase": "Running", "containerStatuses": [cs]}}


def test_a_container_in_crash_loop_backoff_is_reported_with_its_exit_and_message() -> None:
    crashed = pod_view(_raw("CrashLoopBackOff", 3)).crashed
    assert crashed is not None and crashed.startswith("exit 2: ")
    assert crashed.endswith("tp: 2 does not divide num_attention_heads (9)")
    assert "\n" not in crashed  # one line for a condition message
    # one exit (an OOM kill, restarted and running again) or a pod still starting is not a crash loop
    assert pod_view(_raw(None, 1)).crashed is None
    assert pod_view(_raw("ContainerCreating", 0)).crashed is None
    # no message kept (an image without the policy): the exit code and the kubelet's reason still say something
    assert pod_view(_raw("CrashLoopBackOff", 2, message="", code=137)).crashed == "exit 137: Error"


def test_nothing_serving_and_its_engines_crash_looping_stalls_the_service_naming_the_field() -> None:
    bad = dataclasses.replace(pod("svc-fb-1", created_for="svc"), crashed=pod_view(_raw("CrashLoopBackOff", 3)).crashed)
    st = service_status("svc", "svc", reconcile("svc", spec(lo=1), [bad], []), [bad], [], 2)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "EngineCrashLoop"
    msg = conds["Stalled"]["message"]
    assert "svc-fb-1" in msg and "does not divide num_attention_heads (9)" in msg and "spec.engine.tp" in msg
    assert conds["Ready"]["status"] == "False"
    assert kstatus({"metadata": {"generation": 2}, "status": st}) == "Failed"


def test_a_crash_looping_pod_beside_a_serving_replica_degrades_the_service_but_does_not_stall_it() -> None:
    ok = pod("r", "n0", "svc", "colocated", ready=True)
    bad = dataclasses.replace(pod("svc-fb-1", created_for="svc"), crashed="exit 1: CUDA error: out of memory")
    st = service_status("svc", "svc", reconcile("svc", spec(lo=1), [ok, bad], []), [ok, bad], [], 2)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Stalled"]["status"] == "False"
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "EngineCrashLoop"
    assert "svc-fb-1" in conds["Degraded"]["message"] and "spec.engine" not in conds["Degraded"]["message"]
    # another service's crash-looping pod is not this service's business
    other = dataclasses.replace(bad, created_for="other")
    st = service_status("svc", "svc", reconcile("svc", spec(lo=1), [ok, other], []), [ok, other], [], 2)
    assert {c["type"]: c for c in st["conditions"]}["Degraded"]["status"] == "False"


def test_engine_containers_keep_the_tail_of_their_output_as_the_termination_message() -> None:
    engine = fallback_pod(spec(), "svc", "tok", None)["spec"]["containers"][0]
    assert engine["name"] == "engine" and engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    pool = Path(__file__).resolve().parents[2] / "manifests" / "pool" / "deployment.yaml"
    docs = [d for d in yaml.safe_load_all(pool.read_text()) if d and d.get("kind") == "Deployment"]
    containers = [c for d in docs for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert containers and all(c["terminationMessagePolicy"] == "FallbackToLogsOnError" for c in containers)
