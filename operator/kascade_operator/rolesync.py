"""ModelServiceRole objects, the I/O side: read them for a reconcile round, write their status after it.

Data flow: `RoleHandles.read` (kopf index, else the API) -> roleobject.resolve/with_role_counts (pure) ->
the round runs on the adjusted spec -> `RoleHandles.write` -> each object's status (replicas,
readyReplicas, selector, effectiveReplicas, Ready/Stalled) through kube.py, only when it changed.
An object whose ModelService does not exist is answered by `orphan` (its own kopf handler).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kascade_operator import labels as L
from kascade_operator import roleobject as R
from kascade_operator.api import ModelServiceSpec
from kascade_operator.kube import NotFound, now_iso
from kascade_operator.runtime import Runtime


@dataclass
class RoleHandles:
    """The role objects of one service for one round."""

    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> object (this service's)
    resolution: R.Resolution = field(default_factory=lambda: R.Resolution({}, {}))

    @classmethod
    async def read(cls, rt: Runtime, ns: str, name: str, mode: str) -> RoleHandles:
        mine = {str(b["metadata"]["name"]): b for b in await rt.role_objects(ns)
                if ((b.get("spec") or {}).get("modelServiceRef") or {}).get("name") == name}
        return cls(mine, R.resolve(name, mode, (R.RoleObject.of(b) for b in mine.values())))

    def apply(self, spec: ModelServiceSpec) -> tuple[ModelServiceSpec, dict[str, str]]:
        return R.with_role_counts(spec, self.resolution)

    async def write(self, rt: Runtime, ns: str, spec: ModelServiceSpec, pod_selector: str,
                    counts: Mapping[str, Any]) -> None:
        """Each object's status from this round's per-role counts (`counts[role]`: .ready, .loading)."""
        for oname, body in self.bodies.items():
            o = R.RoleObject.of(body)
            c = counts.get(o.role)
            ready = int(c.ready) if c is not None else 0
            replicas = ready + (int(c.loading) if c is not None else 0)
            refused = self.resolution.refused.get(oname)
            old = dict(body.get("status") or {})
            new = R.role_status(o, f"{pod_selector},{L.ROLE}={o.role}", replicas, ready, refused,
                                None if refused else R.effective(spec, o), list(old.get("conditions") or []),
                                now_iso())
            if R.status_differs(old, new):
                with contextlib.suppress(NotFound):  # deleted meanwhile: nothing to report to
                    await rt.kube.patch_modelservicerole_status(ns, oname, new)


async def orphan(rt: Runtime, body: Mapping[str, Any]) -> None:
    """A ModelServiceRole whose ModelService does not exist says so (the service's rounds cannot)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    ns, target = str(meta.get("namespace")), str((spec.get("modelServiceRef") or {}).get("name", ""))
    try:
        await rt.kube.get_modelservice(ns, target)
        return  # the service's own rounds write this object's status
    except NotFound:
        pass
    o = R.RoleObject.of(body)
    old = dict(body.get("status") or {})
    why = f"spec.modelServiceRef.name: ModelService {target!r} not found in namespace {ns!r}"
    new = R.role_status(o, "", 0, 0, why, None, list(old.get("conditions") or []), now_iso())
    if R.status_differs(old, new):
        await rt.kube.patch_modelservicerole_status(ns, o.name, new)
