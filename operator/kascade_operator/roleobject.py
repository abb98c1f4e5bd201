"""ModelServiceRole objects: the scale handle of one role of a disaggregated ModelService (pure).

A CRD has one scale subresource, so an HPA or KEDA ScaledObject aimed at a ModelService drives its
total. To drive prefill and decode on their own metrics, a user creates one ModelServiceRole per role
(`spec.modelServiceRef.name`, `spec.role`) and aims the autoscaler at it; its `spec.replicas` is the
scale subresource's field.

Data flow: the role objects of a namespace (a kopf index) + a ModelServiceSpec -> `resolve` -> which
object scales which role, and the problems of the others -> `with_role_counts` -> the spec with
`replicas.<role>.desired` set (clamped to min..max), so every later step (decide, reconcile, status)
treats the role exactly as a per-role desired count -> `role_status` -> each object's status (replicas,
selector, conditions) for the operator to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kascade_operator.api import ModelServiceSpec, RoleReplicas

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleObject:
    """The fields of one ModelServiceRole the operator reads."""

    name: str
    service: str
    role: str
    replicas: int | None
    generation: int
    created: str  # creationTimestamp: the oldest of two objects for one role wins

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> RoleObject:
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        rep = spec.get("replicas")
        return cls(str(meta.get("name", "")), str((spec.get("modelServiceRef") or {}).get("name", "")),
                   str(spec.get("role", "")), int(rep) if rep is not None else None,
                   int(meta.get("generation") or 0), str(meta.get("creationTimestamp") or ""))


@dataclass(frozen=True)
class Resolution:
    """Which object scales each role of one service, and why the others do not."""

    active: Mapping[str, RoleObject]  # role -> the object that scales it
    refused: Mapping[str, str]  # object name -> the reason it does not scale anything (names the field)


def resolve(service: str, mode: str, objects: Iterable[RoleObject]) -> Resolution:
    """The objects of `service`: one per role scales it (the oldest, then by name); the rest are refused
    with a reason. A colocated service has no roles to hand out: every object is refused."""
    active: dict[str, RoleObject] = {}
    refused: dict[str, str] = {}
    for o in sorted((o for o in objects if o.service == service), key=lambda o: (o.created, o.name)):
        if mode != "disaggregated":
            refused[o.name] = (f"spec.modelServiceRef.name: ModelService {service!r} is in {mode} mode; a "
                               "ModelServiceRole scales a role of a disaggregated service (scale the "
                               "ModelService itself)")
        elif o.role not in ROLES:
            refused[o.name] = f"spec.role: {o.role!r} is not one of {', '.join(ROLES)}"
        elif o.role in active:
            refused[o.name] = (f"spec.role: ModelServiceRole {active[o.role].name!r} already scales the "
                               f"{o.role} role of {service!r}")
        else:
            active[o.role] = o
    return Resolution(active, refused)


def with_role_counts(spec: ModelServiceSpec, res: Resolution) -> tuple[ModelServiceSpec, dict[str, str]]:
    """The spec with each actively scaled role's `desired` set to its object's replicas, clamped to the
    role's min..max; and, per such role, where the count came from (for the decision's reason)."""
    if spec.mode != "disaggregated" or not res.active:
        return spec, {}
    reps = spec.replicas
    changed: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for role, o in res.active.items():
        want = effective(spec, o)
        if want is None or o.replicas is None:
            continue
        bounds = getattr(reps, role)
        changed[role] = bounds.model_copy(update={"desired": want})
        clamp = "" if want == o.replicas else f", clamped to {role} min..max {bounds.min}..{bounds.max}"
        sources[role] = f"ModelServiceRole {o.name} spec.replicas={o.replicas}{clamp}"
    if not changed:
        return spec, {}
    return spec.model_copy(update={"replicas": reps.model_copy(update=changed)}), sources


def effective(spec: ModelServiceSpec, o: RoleObject) -> int | None:
    """The count the operator applies for `o` (its replicas clamped to the role's bounds), if any."""
    bounds: RoleReplicas | None = getattr(spec.replicas, o.role, None) if o.role in ROLES else None
    if o.replicas is None or bounds is None:
        return None
    return max(bounds.min, min(bounds.max, o.replicas))


def role_status(o: RoleObject, selector: str, replicas: int, ready: int, refused: str | None,
                effective_replicas: int | None, conditions: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """The status an object should have; `conditions` are its current ones (a condition keeps its
    lastTransitionTime while its status does not change)."""
    if refused is not None:
        cond = [("Ready", "False", "Refused", refused), ("Stalled", "True", "Refused", refused)]
    elif o.replicas is None:
        msg = "spec.replicas is unset: the ModelService's policy decides this role"
        cond = [("Ready", "True", "PolicyDecides", msg), ("Stalled", "False", "PolicyDecides", msg)]
    elif effective_replicas != o.replicas:
        msg = f"spec.replicas={o.replicas} is outside the role's min..max: the role runs {effective_replicas}"
        cond = [("Ready", "True", "Clamped", msg), ("Stalled", "False", "Clamped", msg)]
    else:
        msg = f"the {o.role} role follows spec.replicas={o.replicas}"
        cond = [("Ready", "True", "Following", msg), ("Stalled", "False", "Following", msg)]
    prev = {c.get("type"): c for c in conditions}
    out = []
    for typ, st, reason, msg in cond:
        old = prev.get(typ) or {}
        t = old.get("lastTransitionTime") if old.get("status") == st else None
        out.append({"type": typ, "status": st, "reason": reason, "message": msg[:1024],
                    "lastTransitionTime": t or now, "observedGeneration": o.generation})
    status: dict[str, Any] = {"replicas": replicas, "readyReplicas": ready, "selector": selector,
                              "observedGeneration": o.generation, "conditions": out}
    if effective_replicas is not None:
        status["effectiveReplicas"] = effective_replicas
    return status


def status_differs(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing `new` changes anything but transition times (no write on every round)."""
    def strip(s: Mapping[str, Any]) -> Any:
        return {**s, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                    for c in s.get("conditions") or []]}
    return bool(strip(current) != strip(new))
