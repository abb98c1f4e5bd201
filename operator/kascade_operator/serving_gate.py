"""The serving readiness gate: the operator's word, beside the engine's own /readyz, on whether a pool
pod may get traffic.

Pool pods declare `readinessGates: [{conditionType: kascade.io/serving}]` (the chart's pool template).
A kubelet then reports the pod Ready only while its readinessProbe (the engine's /readyz) passes AND
this condition is True, so every Service, EndpointSlice, Gateway or InferencePool behaves like the
router. The operator opens the gate only while the pod is bound to a ModelService and its engine is
loaded or serving live (`kascade.io/loaded` / `kascade.io/live`), and closes it the moment a drain
starts (before the engine is drained and released), when the pod is marked unhealthy, and when it
goes back to the pool.

The same decision is also a pod label, `kascade.io/serving: "true"` (absent otherwise), because pool pods
of chart 0.4 no longer declare the gate: an idle pool pod must be Ready (a Deployment counts only Ready
pods as available, and `helm --wait`, Flux and Argo CD wait for that), so its readiness is the engine's
health alone, and serving membership moved to this label. The chart's engines Service and InferencePools
select it; the router reads the binding annotations and this condition where a pod declares the gate.

Data flow: pool pods from the watch-fed index -> `wanted()` (pure) -> `pending()` (pods that declare
the gate and whose condition differs) -> `gate_patch()` -> `Kube.patch_pod_status`. Level-triggered:
`sync()` runs every reconcile round, so a missed write is corrected the next round; `close()` is the
drain's immediate write.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kascade_operator import labels as L
from kascade_operator.kube import Conflict, NotFound, now_iso

log = logging.getLogger(__name__)

GATE = L.SERVING_GATE  # the pod condition type (kascade_router.backends.SERVING_GATE is the same)


SERVING_LABEL = L.SERVING_GATE  # label key, value "true" while wanted() (Services select it)


class _StatusPatcher(Protocol):
    async def patch_pod_status(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...
    async def patch_pod(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...


def declares(pod: Mapping[str, Any]) -> bool:
    return any(g.get("conditionType") == GATE for g in (pod.get("spec") or {}).get("readinessGates") or [])


def current(pod: Mapping[str, Any]) -> bool | None:
    """The gate condition as written on the pod (None: never written)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == GATE:
            return bool(c.get("status") == "True")
    return None


def wanted(pod: Mapping[str, Any]) -> bool:
    """Open only while bound, loaded or live, not draining, not unhealthy, not being deleted."""
    meta = pod.get("metadata") or {}
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    if not labels.get(L.MODEL_SERVICE) or meta.get("deletionTimestamp"):
        return False
    if L.DRAINING in ann or ann.get(L.UNHEALTHY):
        return False
    return ann.get(L.LOADED) == "true" or ann.get(L.LIVE) == "true"


def pending(pods: Iterable[Mapping[str, Any]]) -> list[tuple[str, bool]]:
    """(pod name, open?) for every pod that declares the gate and whose condition is not what it should
    be. A gate never written counts as closed (what a kubelet assumes)."""
    out = []
    for p in pods:
        if declares(p) and (current(p) or False) != wanted(p):
            out.append((str((p.get("metadata") or {}).get("name")), wanted(p)))
    return out


def labelled(pod: Mapping[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(SERVING_LABEL) == "true"


def label_pending(pods: Iterable[Mapping[str, Any]]) -> list[tuple[str, bool]]:
    """(pod name, serving?) for every pod whose serving label is not what wanted() says."""
    return [(str((p.get("metadata") or {}).get("name")), wanted(p)) for p in pods if labelled(p) != wanted(p)]


def label_patch(open_: bool) -> dict[str, Any]:
    """JSON merge patch: the label "true", or removed (null)."""
    return {"metadata": {"labels": {SERVING_LABEL: "true" if open_ else None}}}


def gate_patch(open_: bool, reason: str) -> dict[str, Any]:
    """Strategic-merge patch of the pod status: conditions merge by type, the others stay."""
    return {"status": {"conditions": [{"type": GATE, "status": "True" if open_ else "False",
                                       "reason": reason, "lastTransitionTime": now_iso()}]}}


async def write(kube: _StatusPatcher, ns: str, name: str, open_: bool, reason: str) -> bool:
    try:
        await kube.patch_pod_status(ns, name, gate_patch(open_, reason))
    except (Conflict, NotFound) as e:
        log.debug("serving gate of %s/%s not written: %s", ns, name, e)
        return False
    except Exception as e:  # e.g. 403 without pods/status RBAC: a gate write never breaks a reconcile round
        log.warning("serving gate of %s/%s not written: %s", ns, name, e)
        return False
    log.info("pod %s/%s serving gate %s (%s)", ns, name, "open" if open_ else "closed", reason)
    return True


async def write_label(kube: _StatusPatcher, ns: str, name: str, open_: bool) -> bool:
    try:
        await kube.patch_pod(ns, name, label_patch(open_))
    except NotFound:
        return False
    except Exception as e:  # like a gate write: never breaks a reconcile round (the next one retries)
        log.warning("serving label of %s/%s not written: %s", ns, name, e)
        return False
    log.info("pod %s/%s serving label %s", ns, name, "set" if open_ else "removed")
    return True


async def sync(kube: _StatusPatcher, ns: str, pods: Iterable[Mapping[str, Any]]) -> int:
    """Write every gate and serving label that differs from what the pod's binding says; returns how many
    writes were made."""
    pods = list(pods)
    n = 0
    for name, open_ in pending(pods):
        n += await write(kube, ns, name, open_, "Serving" if open_ else "NotServing")
    for name, open_ in label_pending(pods):
        n += await write_label(kube, ns, name, open_)
    return n


async def close(kube: _StatusPatcher, ns: str, pods: Iterable[Mapping[str, Any]], name: str,
                reason: str = "Draining") -> None:
    """Close pod `name`'s gate and drop its serving label now (a drain starts: Services stop sending
    before the engine is drained)."""
    pod = next((p for p in pods if (p.get("metadata") or {}).get("name") == name), None)
    if pod is not None and labelled(pod):
        await write_label(kube, ns, name, False)
    if pod is not None and declares(pod) and current(pod) is not False:
        await write(kube, ns, name, False, reason)
