"""Status and conditions of ModelService and ScalePlan, in one place (pure).

Conditions follow the kstatus conventions (sigs.k8s.io/cli-utils kstatus, used by Flux, kpt, Argo CD
health checks): `Ready` (True: at the desired replicas and serving), `Reconciling` (True: the operator
is moving the service toward its spec: scaling, waiting for pods), `Stalled` (True: it cannot make
progress without someone changing something: invalid or forbidden spec, no GPU for the pods it needs, engines
that exit as they start with nothing serving: `EngineCrashLoop`, naming the pod, the engine's last words and the
spec field they name).
Each carries the full metav1.Condition fields (type, status, reason, message, lastTransitionTime,
observedGeneration), and `status.observedGeneration` says which spec generation the status describes.
The Deployment-style `Available` / `Progressing` / `Degraded` are kept for `kubectl get` and for
people used to them. A kstatus reader therefore calls a Degraded service InProgress or Failed, never
Current.

Data flow: reconcile `Result` + observed pods/plans + the decision -> `service_status()` -> the typed
`ModelServiceStatus` (api.py) -> dumped camelCase for the status patch; ScalePlan phase ->
`plan_conditions()`. Transition times of unchanged conditions are kept (`keep_transition_times`), so an
unchanged status compares equal and is not written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kascade_operator import labels as L
from kascade_operator.api import Condition, ModelServiceStatus
from kascade_operator.kube import now_iso
from kascade_operator.pool import PodView, can_serve
from kascade_operator.reconcile import TERMINAL, PlanView, Result


@dataclass(frozen=True)
class Blocker:
    """Why the service cannot progress on its own (-> Stalled=True): reason + message naming the field."""

    reason: str
    message: str


def condition(ctype: str, ok: bool, reason: str, message: str, gen: int | None) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message[:1024],
            "lastTransitionTime": now_iso(), "observedGeneration": gen}


def keep_transition_times(new: list[dict[str, Any]], old: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A condition whose status did not change keeps its lastTransitionTime (and so compares equal)."""
    prev = {c.get("type"): c for c in old}
    out = []
    for c in new:
        p = prev.get(c["type"])
        if p and p.get("status") == c["status"]:
            c = {**c, "lastTransitionTime": p.get("lastTransitionTime", c["lastTransitionTime"])}
        out.append(c)
    return out


def _dump(st: ModelServiceStatus) -> dict[str, Any]:
    return st.model_dump(by_alias=True, exclude_none=True)


def invalid_status(message: str, gen: int | None, reason: str = "InvalidSpec") -> dict[str, Any]:
    """A spec the operator refuses: Stalled until someone edits it."""
    conds = [condition("Ready", False, reason, message, gen),
             condition("Reconciling", False, reason, "spec rejected; fix the named field", gen),
             condition("Stalled", True, reason, message, gen),
             condition("Available", False, reason, "spec rejected", gen),
             condition("Progressing", False, reason, "spec rejected", gen),
             condition("Degraded", True, reason, message, gen)]
    return _dump(ModelServiceStatus(observed_generation=gen, conditions=[Condition.model_validate(c) for c in conds]))


# An engine's refusal at start names its flag ("tp: 3 does not divide num_attention_heads (9)"); the field of the
# ModelService that set that flag, so the condition names what to edit.
ENGINE_FLAG_FIELDS = {"tp": "spec.engine.tp", "dtype": "spec.engine.dtype"}


def crash_report(key: str, pods: Sequence[PodView]) -> str | None:
    """The service's engine pods (bound to it, or fallback pods created for it) whose engine keeps exiting, said
    once: the first pod's exit and message, the ModelService field its message names, how many more."""
    bad = sorted((p for p in pods if p.crashed and (p.model_service == key or p.created_for == key)),
                 key=lambda p: p.pod_name)
    if not bad:
        return None
    first = str(bad[0].crashed)
    fields = [f for flag, f in ENGINE_FLAG_FIELDS.items() if re.search(rf"(?<![\w-]){flag}: ", first)]
    more = f" (and {len(bad) - 1} more pod(s))" if len(bad) > 1 else ""
    return (f"the engine of pod {bad[0].pod_name} keeps exiting ({first}){more}"
            + (f"; check {', '.join(fields)}" if fields else ""))


def service_status(key: str, name: str, res: Result, pods: Sequence[PodView], plans: Sequence[PlanView],
                   gen: int | None, blocker: Blocker | None = None, model: str | None = None) -> dict[str, Any]:
    """The ModelService status after one round. `key`: the service key its pods carry; `name`: its name
    (the selector is a label selector: label values hold the name). `sources`: its ready engines (gpu) and
    the idle pool pods keeping `model` in host memory (host)."""
    summary = ", ".join(f"{k} {v.ready}/{v.desired}" for k, v in res.roles.items())
    crash = crash_report(key, pods)
    notes = "; ".join([*res.notes, *([crash] if crash else [])])
    if blocker is None and crash and not res.available:  # nothing serves, and its engines exit as they start
        blocker = Blocker("EngineCrashLoop", crash)
    at_desired = all(r.ready == r.desired and r.loading == 0 for r in res.roles.values())
    if blocker is None and res.exhausted:
        blocker = Blocker("PoolExhausted", f"{notes}; {res.coming} pod(s) created for it cannot be scheduled "
                                           f"(no free GPU)")
    if blocker is not None:
        ready = condition("Ready", False, blocker.reason, blocker.message, gen)
        reconciling = condition("Reconciling", False, blocker.reason, "waiting for a change (see Stalled)", gen)
        stalled = condition("Stalled", True, blocker.reason, blocker.message, gen)
    elif res.progressing or not at_desired:
        why = "PoolShort" if res.short else "Scaling"
        ready = condition("Ready", False, why, notes or f"scaling: {summary}", gen)
        reconciling = condition("Reconciling", True, why, notes or f"scaling: {summary}", gen)
        stalled = condition("Stalled", False, why, "making progress", gen)
    else:
        ready = condition("Ready", True, "AtDesiredReplicas", summary, gen)
        reconciling = condition("Reconciling", False, "AtDesiredReplicas", summary, gen)
        stalled = condition("Stalled", False, "AtDesiredReplicas", summary, gen)
    degraded = blocker is not None or bool(notes)
    degraded_reason = blocker.reason if blocker else ("PoolShort" if res.notes else "EngineCrashLoop" if crash
                                                      else "AsExpected")
    conds = [
        ready,
        reconciling,
        stalled,
        condition("Available", res.available, "ReplicasReady" if res.available else "NoReadyReplica", summary, gen),
        condition(
            "Progressing",
            res.progressing,
            "Scaling" if res.progressing else "Stable",
            notes or ("scaling" if res.progressing else "at desired replicas"),
            gen,
        ),
        condition(
            "Degraded", degraded, degraded_reason, (blocker.message if blocker else notes) or "spec accepted", gen
        ),
    ]
    st = {
        "observedGeneration": gen,
        "readyReplicas": sum(r.ready for r in res.roles.values()),
        "loadingReplicas": sum(r.loading for r in res.roles.values()),
        "selector": f"{L.MODEL_SERVICE}={name}",
        "replicas": {role: {"desired": r.desired, "ready": r.ready, "loading": r.loading}
                     for role, r in res.roles.items()},
        "sources": [{"kind": "gpu", "location": p.pod_name, "node": p.node} for p in pods
                    if p.model_service == key and p.ready]
                   # host copies: released pods this service may bind, and its own serving pods that keep one
                   + [{"kind": "host", "location": p.pod_name, "node": p.node} for p in pods
                      if model is not None and p.host_copy == model
                      and (p.model_service == key or (p.model_service is None and can_serve(p, model, key)))],
        "conditions": conds,
    }
    out = _dump(ModelServiceStatus.model_validate(st))
    # explicit null: a merge patch must clear the previous round's plan
    out["activePlan"] = next((p.name for p in plans if p.phase not in TERMINAL), None)
    return out


def plan_conditions(phase: str, message: str, gen: int | None) -> list[dict[str, Any]]:
    """ScalePlan: Ready when Succeeded, Reconciling while it runs, Stalled when Failed."""
    msg = message or phase
    return [condition("Ready", phase == "Succeeded", phase or "Pending", msg, gen),
            condition("Reconciling", phase not in TERMINAL, phase or "Pending", msg, gen),
            condition("Stalled", phase == "Failed", phase or "Pending", msg, gen)]


def kstatus(obj: Mapping[str, Any]) -> str:
    """What a kstatus reader concludes for a Kascade object (its generic rules for custom resources:
    observedGeneration behind -> InProgress; Reconciling True -> InProgress; Stalled True -> Failed;
    else Current). Used by tests and by `kascade` tooling; the Argo CD Lua check mirrors it."""
    gen = (obj.get("metadata") or {}).get("generation")
    st = obj.get("status") or {}
    if gen is not None and st.get("observedGeneration") != gen:
        return "InProgress"
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    if (conds.get("Reconciling") or {}).get("status") == "True":
        return "InProgress"
    if (conds.get("Stalled") or {}).get("status") == "True":
        return "Failed"
    return "Current"
