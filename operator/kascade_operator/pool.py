"""The warm pool: idle engine pods, which ones to bind on scale-up, which to drain on scale-down, and
the label/annotation patches that record a binding.

Data flow: Pod dicts (kube.py) -> `PodView` -> `choose_targets` / `choose_drain` (pure, deterministic)
-> `bind_patch` / `unbind_patch` -> kube.py applies them. Every patch carries the pod's
`metadata.resourceVersion`: the API server rejects it with 409 if anything changed the pod since it
was read, so two operators (or an operator restarted mid-plan that reads stale state) can never bind
one pod twice; the loser re-reads and re-plans.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kascade_operator import capacity
from kascade_operator import labels as L
from kascade_operator.api import EngineCapacity


@dataclass(frozen=True)
class PodView:
    pod_name: str
    node: str | None
    resource_version: str
    pool: bool  # a warm-pool engine pod
    model_service: str | None
    role: str | None
    ready: bool  # pod Ready and the engine reported the model loaded (annotation kascade.io/loaded)
    draining: bool = False
    drained: bool = False  # the engine reported no requests in flight since the drain
    endpoint: str | None = None
    data_endpoint: str | None = None
    instance: str = ""
    plan: str | None = None
    leaf: str | None = None  # the node's leaf label (filled in when the node is known)
    unhealthy: str | None = None  # why the operator dropped this engine from a plan (unreachable)
    act_endpoint: str | None = None  # where the engine finishes split requests of a live-paired target
    model: str | None = None  # the model its engine serves (annotation kascade.io/model); None: any model
    created_for: str | None = None  # service key a fallback pod was created for (only that service binds it)
    pod_ready: bool = True  # the pod's Ready condition (the engine's /readyz: serving)
    running: bool = True  # phase Running and every container started (startupProbe passed); else not a target
    unschedulable: bool = False  # the scheduler found no node for it (PodScheduled False, Unschedulable)
    namespace: str = ""
    convertible: bool = False  # a decoder converted to take prefill too (annotation kascade.io/convertible)
    host_copy: str | None = None  # the model its engine keeps in host memory (annotation kascade.io/host-copy)
    host_copy_refused: str | None = None  # the model its engine declined to keep a copy of (its budget)
    capacity: str | None = None  # the engine's capacity flags (annotation kascade.io/engine-capacity)
    tp: int = 1  # the engine's tensor-parallel ranks (annotation kascade.io/engine-tp; absent: 1)
    preempted_for: str | None = None  # draining for another service (annotation kascade.io/preempted-for)
    crashed: str | None = None  # its engine keeps exiting (CrashLoopBackOff): the last exit code and message


def service_key(namespace: str, name: str, pool_namespace: str) -> str:
    """How pods name the service they serve: its name when the pool lives in the service's namespace,
    "namespace/name" when the pool lives elsewhere (two namespaces may both have a service `chat`)."""
    return name if namespace == pool_namespace else f"{namespace}/{name}"


def _addresses(pod: Mapping[str, Any]) -> dict[str, str]:
    """In a cluster the engine listens on the pod IP at its named container ports (http, data, act);
    annotations (set by the local harness, or by hand) take precedence."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return {}
    named = {p.get("name"): p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or []
             for p in c.get("ports") or [] if p.get("name")}
    return {key: f"{ip}:{named[port]}" for key, port in ((L.ENDPOINT, "http"), (L.DATA_ENDPOINT, "data"),
                                                          (L.ACT_ENDPOINT, "act")) if named.get(port)}


def pod_view(pod: Mapping[str, Any], node_leaf: Mapping[str, str] | None = None) -> PodView:
    meta = pod.get("metadata") or {}
    lab, ann = meta.get("labels") or {}, {**_addresses(pod), **(meta.get("annotations") or {})}
    conds = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    phase = (pod.get("status") or {}).get("phase")
    # a container's startupProbe (the engine's /healthz) has passed: its HTTP server answers. Without
    # this a just-started engine (torch still importing) was bound, stayed unreachable for
    # UNREACHABLE_LIMIT_S and was marked unhealthy for good. No containerStatuses / no `started`: as before.
    started = all(cs.get("started") is not False for cs in (pod.get("status") or {}).get("containerStatuses") or [])
    unschedulable = any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                        and c.get("reason") == "Unschedulable" for c in conds)
    node = (pod.get("spec") or {}).get("nodeName")
    ns = str(meta.get("namespace") or "")
    svc, svc_ns = lab.get(L.MODEL_SERVICE), ann.get(L.SERVICE_NS)
    if svc is not None and svc_ns and svc_ns != ns:
        svc = f"{svc_ns}/{svc}"
    return PodView(
        pod_name=str(meta.get("name")), node=node, resource_version=str(meta.get("resourceVersion", "")),
        pool=lab.get(L.POOL) in (L.POOL_WARM, L.POOL_BOUND), model_service=svc, role=lab.get(L.ROLE),
        ready=ready and ann.get(L.LOADED) == "true", draining=L.DRAINING in ann,
        drained=ann.get(L.DRAINING + "-done") == "true", endpoint=ann.get(L.ENDPOINT),
        data_endpoint=ann.get(L.DATA_ENDPOINT), instance=ann.get(L.INSTANCE) or str(meta.get("name")),
        plan=ann.get(L.PLAN), leaf=(node_leaf or {}).get(node or ""), unhealthy=ann.get(L.UNHEALTHY),
        act_endpoint=ann.get(L.ACT_ENDPOINT), model=ann.get(L.MODEL), created_for=ann.get(L.CREATED_FOR),
        pod_ready=ready, unschedulable=unschedulable, namespace=ns,
        running=phase in (None, "Running") and started, convertible=ann.get(L.CONVERTIBLE) == "true",
        host_copy=ann.get(L.HOST_COPY) or None, host_copy_refused=ann.get(L.HOST_COPY_REFUSED) or None,
        capacity=ann.get(L.ENGINE_CAPACITY), tp=_tp(ann.get(L.ENGINE_TP)),
        preempted_for=ann.get(L.PREEMPTED_FOR) or None, crashed=crash_loop(pod))


def crash_loop(pod: Mapping[str, Any]) -> str | None:
    """Why a pod's container keeps exiting, when the kubelet backs off restarting it (CrashLoopBackOff): "exit
    <code>: <message>", the message being what the container left in its termination log (the engine's
    containers say `terminationMessagePolicy: FallbackToLogsOnError`, so it is the tail of the engine's output: a
    refused flag names the flag, e.g. `tp: 3 does not divide num_attention_heads (9)`). One exit is not a crash
    loop: a pod restarted once (an OOM kill) is not reported."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") != "CrashLoopBackOff":
            continue
        last = (cs.get("lastState") or {}).get("terminated") or {}
        text = " ".join(str(last.get("message") or last.get("reason") or waiting.get("message") or "").split())
        return f"exit {last.get('exitCode', '?')}: {text[-400:]}" if text else f"exit {last.get('exitCode', '?')}"
    return None


def _tp(text: str | None) -> int:
    """The engine's --tp from its pod's annotation (absent or malformed: 1, the pool's engines)."""
    return int(text) if text and text.isdigit() and int(text) >= 1 else 1


def can_serve(p: PodView, model: str, service: str, cap: EngineCapacity | None = None, tp: int = 1) -> bool:
    """An idle pool pod this service may bind: its engine serves this model (or any), it was not created
    as a fallback for another service, it was started with the capacity the service asks for, and it runs
    the service's tensor-parallel degree (spec.engine.tp: a TP-g service binds only pods started with --tp g)."""
    return ((p.model is None or p.model == model) and (p.created_for is None or p.created_for == service)
            and capacity.matches(p.capacity, cap) and p.tp == tp)


def choose_targets(idle: Sequence[PodView], k: int, source_leaves: Collection[str | None]) -> list[PodView]:
    """Pick `k` idle, healthy pods with a node and an engine endpoint: first those on a source's leaf (fast,
    leaf-local chains), then by leaf and node so a node's pods stay adjacent (one NVLink domain per
    chain hop), then by name (deterministic). Pods keeping a host copy come last (binding one as a chain
    target drops its copy: reconcile binds those from their copy, `host_copies`)."""
    if k <= 0:
        return []
    leaves = set(source_leaves) - {None}
    usable = [p for p in idle if usable_target(p)]
    usable.sort(key=lambda p: (p.host_copy is not None, p.leaf not in leaves, p.leaf or "", p.node or "",
                               p.pod_name))
    return usable[:k]


def host_copies(idle: Sequence[PodView], model: str) -> list[PodView]:
    """Idle pool pods whose released engine keeps `model` in host memory, usable, by name."""
    return sorted((p for p in idle if p.host_copy == model and usable_target(p)), key=lambda p: p.pod_name)


def copy_key(p: PodView, node_cache: bool) -> str:
    """What one host copy is per: the pod's node when the pool's engines share a node cache (`node_cache`: the
    chart's pool.nodeCache; every engine of a node maps the node's one copy, ADR 16), else the pod itself. A
    fallback pod (created for one service) has no node cache: its copy is its own."""
    return f"node/{p.node}" if node_cache and p.node and p.created_for is None else f"pod/{p.pod_name}"


def keep_host_copy(pods: Sequence[PodView], model: str, releasing: str, per_model: int,
                   node_cache: bool = False) -> bool | None:
    """The `keepHostCopy` a release of pod `releasing` sends: None (the engine keeps a copy when its
    --host-cache-gib holds the model) while fewer than `per_model` other released pool pods keep `model`, False
    (drop the weights) beyond, so the pool holds O(1) host copies per model. A serving replica's copy does not
    count: it is the stopgap that keeps a served model from having none (hostcopykeeper), and it gives way to
    a released one (an extra scale-up source beside the serving replicas, on a pod that serves nothing), which
    the keeper then drops (`hostcopykeeper.surplus`). Counting it made the outcome of a scale-down depend on
    whether the keeper had run before it (issue 40). With a node cache (`node_cache`) copies are counted per
    node (`copy_key`): a release on a node whose copy is counted already keeps it (the same bytes, no more)."""
    by = {p.pod_name: p for p in pods}
    held = {copy_key(q, node_cache) for q in pods
            if q.host_copy == model and q.pod_name != releasing and q.model_service is None}
    me = by.get(releasing)
    if me is not None and copy_key(me, node_cache) in held:
        return None
    return None if len(held) < per_model else False


def host_copy_patch(model: str | None, refused: str | None = None) -> dict[str, Any]:
    """Record (model) or clear (None) the host copy a pod's engine keeps; with `refused`, record instead that
    its engine declined to keep a copy of that model."""
    if refused is not None:
        return {"metadata": {"annotations": {L.HOST_COPY_REFUSED: refused}}}
    return {"metadata": {"annotations": {L.HOST_COPY: model}}}


def usable_target(p: PodView) -> bool:
    """Scheduled, reachable (an engine address) and never dropped as unhealthy. Not the pod's Ready
    condition: the pool's readinessProbe is the engine's /readyz, which an idle (unbound) engine fails
    by design (routers send it nothing); the pod must be Running (its containers started), and an engine
    that does not answer is dropped at bind time."""
    return bool(p.node and p.endpoint and p.running and not p.unhealthy)


def choose_drain(serving: Sequence[PodView], k: int, keep_last: bool = True) -> list[PodView]:
    """Pick up to `k` pods to drain: not-ready ones first, then newest names; never the last ready pod
    (unless `keep_last` is off: scale to zero after an idle time, replicas.min 0)."""
    order = sorted(serving, key=lambda p: (p.ready, [-ord(c) for c in p.pod_name]))
    ready_left = sum(p.ready for p in serving) + (0 if keep_last else 1)
    out: list[PodView] = []
    for p in order:
        if len(out) == k:
            break
        if p.ready:
            if ready_left <= 1:
                continue  # the last copy of the model is never released
            ready_left -= 1
        out.append(p)
    return out


def bind_patch(p: PodView, model_service: str, role: str, plan: str, owner: Mapping[str, Any] | None = None,
               service_namespace: str | None = None, host_copy: str | None = None) -> dict[str, Any]:
    """Merge patch binding an idle pod (written once its engine accepted the bind); the resourceVersion
    makes it fail (409) if the pod changed. `owner`: the ModelService's controller ownerReference (same
    namespace only); it replaces the pool ReplicaSet's, which lets go of the pod anyway once the
    `kascade.io/pool` label no longer matches its selector. `model_service` is the plain name (a label
    value); `service_namespace` is set when the pool lives in another namespace. `host_copy`: the model whose
    host copy the bound engine still keeps (it bound from that copy, which stays kept while it serves: a
    model's copies never drop to zero at a scale from zero), else None (any old record cleared)."""
    if p.model_service is not None:
        raise ValueError(f"pod {p.pod_name} is already bound to {p.model_service}")
    meta: dict[str, Any] = {"resourceVersion": p.resource_version,
                            "labels": {L.MODEL_SERVICE: model_service, L.ROLE: role, L.POOL: L.POOL_BOUND},
                            "annotations": {L.PLAN: plan, L.HOST_COPY: host_copy,
                                            **({L.SERVICE_NS: service_namespace} if service_namespace else {})}}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {"metadata": meta}


def owner_ref(service: Mapping[str, Any]) -> dict[str, Any]:
    """A controller ownerReference to a ModelService (its metadata: name, uid)."""
    return {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "name": service["name"],
            "uid": service["uid"], "controller": True, "blockOwnerDeletion": True}


def drain_patch(p: PodView, now_iso: str, preempted_for: str | None = None) -> dict[str, Any]:
    """Start draining `p`; `preempted_for`: the arbitration entry it is drained for (its release goes there)."""
    ann = {L.DRAINING: now_iso, **({L.PREEMPTED_FOR: preempted_for} if preempted_for else {})}
    return {"metadata": {"resourceVersion": p.resource_version, "annotations": ann}}


def drained_patch(p: PodView) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": p.resource_version, "annotations": {L.DRAINING + "-done": "true"}}}


def unbind_patch(p: PodView, unhealthy: str | None = None, host_copy: str | None = None) -> dict[str, Any]:
    """Return a drained pod to the pool (merge patch: null deletes the key); with `unhealthy`, a dead
    engine's pod leaves its service and is marked so it is never chosen as a target again. A pool pod
    loses the service's ownerReference (the pool ReplicaSet may adopt it again); a fallback pod created
    for the service keeps it (it is the service's, and goes with it). `host_copy`: the model its released
    engine keeps in host memory (recorded), or None (any old record cleared)."""
    meta: dict[str, Any] = {"resourceVersion": p.resource_version,
                            "labels": {L.MODEL_SERVICE: None, L.ROLE: None, L.POOL: L.POOL_WARM},
                            "annotations": {L.PLAN: None, L.LOADED: None, L.LIVE: None, L.DRAINING: None,
                                            L.DRAINING + "-done": None, L.SERVICE_NS: None,
                                            L.CONVERTIBLE: None, L.HOST_COPY: host_copy, L.PREEMPTED_FOR: None,
                                            **({L.UNHEALTHY: unhealthy[:200]} if unhealthy else {})}}
    if p.created_for is None:
        meta["ownerReferences"] = None
    return {"metadata": meta}
