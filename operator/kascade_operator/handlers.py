"""Thin kopf handlers: observe -> pure decision -> apply through kube.py and the engine client.

Data flow:
- ModelService create/update/resume and a periodic timer -> `reconcile_service`: parse the spec
  (invalid -> Degraded condition + Event naming the field), list pool pods and ScalePlans, scrape the
  bound engines, run the policy (`decide`) and the reconciler, apply the actions, patch the status.
- ScalePlan daemon (`drive_plan`, one per non-terminal ScalePlan; kopf restarts it after an operator
  restart) -> `plandriver.drive`: bind targets, instruct engines once, write throttled progress.
- ModelService delete (finalizer) -> drain and release every bound pod, so the pool gets them back.
Handlers keep no state of their own; everything lives in `Runtime` (kopf memo) or in the API server.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleDecision, decide
from kascade_operator.demand import RouterDemand, zero_rule
from kascade_operator.engine_client import EngineClient, EngineError
from kascade_operator.kube import GROUP, VERSION, Conflict, Kube, NotFound, now_iso
from kascade_operator.metrics import PrometheusSource, Scraper, snapshot
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.pool import PodView, drain_patch, unbind_patch
from kascade_operator.reconcile import (
    TERMINAL,
    CreatePlan,
    CreatePods,
    Drain,
    PlanView,
    Release,
    Result,
    reconcile,
    role_bounds,
)
from kascade_operator.runtime import ALL, Runtime
from kascade_operator.settings import OperatorSettings
from kascade_operator.validation import semantic_errors

log = logging.getLogger(__name__)


def field_errors(e: ValidationError) -> str:
    """'spec.replicas.colocated.min: Input should be ...; ...' — the field path the user must fix."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in ("spec", *err["loc"]))
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def condition(ctype: str, ok: bool, reason: str, message: str, gen: int | None) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message[:1024],
            "lastTransitionTime": now_iso(), "observedGeneration": gen}


def keep_transition_times(new: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A condition whose status did not change keeps its lastTransitionTime (and so compares equal)."""
    prev = {c.get("type"): c for c in old}
    out = []
    for c in new:
        p = prev.get(c["type"])
        if p and p.get("status") == c["status"]:
            c = {**c, "lastTransitionTime": p.get("lastTransitionTime", c["lastTransitionTime"])}
        out.append(c)
    return out


def _active_plan_ages(raw_plans: list[dict[str, Any]], service: str) -> list[float]:
    """Seconds since creation of the service's unfinished ScalePlans (for the scale-up-stuck alert)."""
    now = datetime.now(UTC)
    return [(now - datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))).total_seconds()
            for p in raw_plans if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == service
            and (p.get("status") or {}).get("phase") not in TERMINAL and p["metadata"].get("creationTimestamp")]


def plan_view(sp: dict[str, Any]) -> PlanView:
    spec, st = sp.get("spec") or {}, sp.get("status") or {}
    return PlanView(sp["metadata"]["name"], spec.get("role", ""), st.get("phase") or "",
                    tuple(t.get("pod") or t["instance"] for t in spec.get("targets") or []))


async def observe(rt: Runtime, ns: str) -> tuple[list[PodView], list[dict[str, Any]]]:
    leaf, _ = await rt.node_facts()
    pods = rt.pod_views(await rt.pool_pods(ns), leaf)
    # a draining pod is "drained" when release succeeds; try it every round (409 = still in flight)
    pods = [p.__class__(**{**p.__dict__, "drained": p.draining}) if p.draining else p for p in pods]
    return pods, await rt.scaleplans(ns)


async def reconcile_service(rt: Runtime, body: dict[str, Any], trigger: str) -> Result | None:
    # kopf runs timers and change handlers of one object concurrently: one reconcile at a time per
    # ModelService, or two rounds would both see "no plan yet" and create two ScalePlans.
    meta = body["metadata"]
    async with rt.lock(meta["namespace"], "modelservice/" + meta["name"]):
        return await _reconcile_service(rt, body, trigger)


async def _reconcile_service(rt: Runtime, body: dict[str, Any], trigger: str) -> Result | None:
    t0 = time.perf_counter()
    meta = body["metadata"]
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    try:
        spec = ModelServiceSpec.model_validate(body.get("spec") or {})
        problems = semantic_errors(spec, (await rt.node_facts())[1], rt.settings.gpu_resource)
    except ValidationError as e:
        problems = [field_errors(e)]
    if problems:
        msg = "; ".join(problems)
        if rt.invalid_seen.get((ns, name)) != gen:
            rt.invalid_seen[(ns, name)] = gen or 0
            await rt.kube.event(ns, body, "ModelService", "Warning", "InvalidSpec", msg)
            await rt.kube.patch_modelservice_status(ns, name, {"observedGeneration": gen, "conditions": [
                condition("Degraded", True, "InvalidSpec", msg, gen),
                condition("Available", False, "InvalidSpec", "spec rejected", gen),
                condition("Progressing", False, "InvalidSpec", "spec rejected", gen)]})
        return None
    rt.invalid_seen.pop((ns, name), None)
    pods, raw_plans = await observe(rt, ns)
    plans = [plan_view(p) for p in raw_plans if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == name]
    rt.metrics.pool_size.labels(ns).set(sum(1 for p in pods if p.model_service is None))

    desired: dict[str, int] = {}
    release_last: set[str] = set()
    reasons, last = [], None
    for role, b in role_bounds(spec).items():
        serving = [p for p in pods if p.model_service == name and p.role == role and not p.draining]
        ready = {p.instance: p.endpoint for p in serving if p.ready and p.endpoint}
        key = (ns, name, role)
        if role == "colocated" and spec.replicas.desired is not None:
            # one writer at a time: while the scale subresource (kubectl scale, HPA, KEDA, GitOps) sets
            # replicas.desired, it is the decision and the policy stays off; reconcile() reads it
            want = max(b.min, min(b.max, spec.replicas.desired))
            if want != len(serving):
                why = f"spec.replicas.desired={spec.replicas.desired} (scale subresource; the policy is off while it is set)"
                rt.metrics.decisions.labels("scaleSubresource", "up" if want > len(serving) else "down").inc()
                reasons.append(why)
                last = {"time": now_iso(), "policy": "scaleSubresource", "role": role, "from": len(serving),
                        "to": want, "reason": why, "metrics": {}}
                log.info("%s/%s decision %s %d -> %d: %s", ns, name, role, len(serving), want, why)
            continue
        if rt.prometheus is not None:
            loads = await rt.prometheus.collect([p.pod_name for p in serving if p.ready])
        else:
            assert rt.scraper is not None
            loads = await rt.scraper.collect(ready, key)
        snap = snapshot(loads, time.monotonic())
        log.debug("%s/%s %s: %d ready scraped, %.0f in tok/s", ns, name, role, len(loads), snap.input_tokens_per_s)
        d = decide(spec, role, len(serving), b.min, b.max, snap, rt.below_since.get(key))
        rt.below_since[key] = d.state.below_since_s
        d, may_release_last = await _zero(rt, spec, key, len(serving), b.min, snap, d)
        if may_release_last:
            release_last.add(role)
        if trigger == "timer" or d.desired != d.current:
            desired[role] = d.desired
        if d.desired != d.current:
            rt.metrics.decisions.labels(d.policy, "up" if d.desired > d.current else "down").inc()
            reasons.append(d.reason)
            log.info("%s/%s decision %s %d -> %d: %s", ns, name, role, d.current, d.desired, d.reason)
            last = {"time": now_iso(), "policy": d.policy, "role": role, "from": d.current, "to": d.desired,
                    "reason": d.reason[:1024], "metrics": {k: float(v) for k, v in d.metrics.items()}}
    # targets other services' plans hold (their binds may not be in the pod index yet), claimed pods
    # included; choosing and claiming happen with no await in between, so two services never pick one pod
    others = {t.get("pod") or t["instance"] for p in raw_plans
              if (p.get("status") or {}).get("phase") not in TERMINAL for t in (p.get("spec") or {}).get("targets") or []}
    res = reconcile(name, spec, pods, plans, desired or None, "; ".join(reasons), others | rt.reserved(ns),
                    release_last)
    rt.metrics.observe_service(ns, name, res.roles, _active_plan_ages(raw_plans, name))
    for action in res.actions:
        if isinstance(action, CreatePlan):
            rt.reserve(ns, action.targets)
    decided_at = time.perf_counter()
    for action in res.actions:
        await apply(rt, body, spec, pods, action, decided_at)
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "readyReplicas": sum(r.ready for r in res.roles.values()),
        "loadingReplicas": sum(r.loading for r in res.roles.values()),
        "selector": f"{L.MODEL_SERVICE}={name}",
        **({"url": rt.settings.router_url.rstrip("/") + "/v1"} if rt.settings.router_url else {}),
        "replicas": {role: {"desired": r.desired, "ready": r.ready, "loading": r.loading} for role, r in res.roles.items()},
        "sources": [{"kind": "gpu", "location": p.pod_name, "node": p.node} for p in pods
                    if p.model_service == name and p.ready],
        "activePlan": next((p.name for p in plans if p.phase not in TERMINAL), None),
        "conditions": [condition("Available", res.available, "ReplicasReady" if res.available else "NoReadyReplica",
                                 ", ".join(f"{k} {v.ready}/{v.desired}" for k, v in res.roles.items()), gen),
                       condition("Progressing", res.progressing, "Scaling" if res.progressing else "Stable",
                                 "; ".join(res.notes) or ("scaling" if res.progressing else "at desired replicas"), gen),
                       condition("Degraded", bool(res.notes), "PoolShort" if res.notes else "AsExpected",
                                 "; ".join(res.notes) or "spec accepted", gen)],
    }
    if last:
        status["lastDecision"] = last
    old = body.get("status") or {}
    status["conditions"] = keep_transition_times(status["conditions"], old.get("conditions") or [])
    if any(old.get(k) != v for k, v in status.items()):
        # unchanged status is not written: at a sub-second interval every write is a watch event for
        # every ModelService watcher, and the API server is the record, not the fast path
        await rt.kube.patch_modelservice_status(ns, name, status)
    rt.metrics.reconcile.labels(trigger).observe(time.perf_counter() - t0)
    return res


async def _zero(rt: Runtime, spec: ModelServiceSpec, key: tuple[str, str, str], current: int, lo: int,
                snap: Any, d: RoleDecision) -> tuple[RoleDecision, bool]:
    """Scale from zero on the router's demand (no engine exists to be scraped) and to zero after an idle
    time with min 0; otherwise the policy's decision stands."""
    now = time.monotonic()
    dem = await rt.router.get(key[0], key[1]) if rt.router is not None else None
    if snap.in_flight > 0 or snap.output_tokens_per_s > 0 or (dem is not None and (dem.active or dem.requests_per_s > 0)) \
            or key not in rt.last_busy:
        rt.last_busy[key] = now
    idle = now - rt.last_busy[key]
    if dem is not None and dem.idle_s is not None:
        idle = min(idle, dem.idle_s)
    after = spec.scaling.idle_release_seconds if spec.scaling else 300.0
    want, why, release_last = zero_rule(current, lo, d.desired, dem, idle, after)
    if want != d.desired or why:
        d = dataclasses.replace(d, desired=want, reason=why or d.reason)
    return d, release_last


async def apply(rt: Runtime, body: dict[str, Any], spec: ModelServiceSpec, pods: list[PodView], action: Any,
                decided_at: float) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    by_name = {p.pod_name: p for p in pods}
    if isinstance(action, CreatePlan):
        t0 = time.perf_counter()
        try:
            sp = await plandriver.new_scaleplan(rt, body, spec, action, by_name, await rt.nodes())
        except ValueError as e:
            await rt.kube.event(ns, body, "ModelService", "Warning", "PlanFailed", str(e))
            return
        rt.metrics.plan_generation.observe(time.perf_counter() - t0)
        created = await rt.kube.create_scaleplan(ns, sp)
        if not await rt.seen_plan(ns, created["metadata"]["name"]):
            log.warning("ScalePlan %s/%s not in the watch after 2 s", ns, created["metadata"]["name"])
        await rt.kube.event(ns, body, "ModelService", "Normal", "ScaleUp",
                            f"{action.role}: ScalePlan {created['metadata']['name']} binds "
                            f"{', '.join(action.targets)} ({action.reason})")
        # the fast path: instruct now instead of waiting for the ScalePlan daemon to start
        await plandriver.start(rt, created, decided_at)
    elif isinstance(action, CreatePods):
        await rt.kube.event(ns, body, "ModelService", "Warning", "PoolEmpty",
                            f"{action.role}: warm pool short by {action.count}; creating pods (slow path)")
        try:
            pod = plandriver.fallback_pod(spec, name, action.role, rt.settings.engine_token_secret)
        except ValueError as e:
            await rt.kube.event(ns, body, "ModelService", "Warning", "PoolEmpty", f"{action.role}: {e}")
            return
        for _ in range(action.count):
            await rt.kube.create_pod(ns, pod)
    elif isinstance(action, Drain):
        # routers stop sending to the pod first (they watch this annotation); the engine itself is drained
        # a round later, with its release, so no request ever arrives at a draining engine
        p = by_name[action.pod]
        try:
            await rt.kube.patch_pod(ns, p.pod_name, drain_patch(p, now_iso()))
        except Conflict:
            return  # re-read next round
        await rt.kube.event(ns, body, "ModelService", "Normal", "ScaleDown", f"draining {p.pod_name}")
    elif isinstance(action, Release):
        p = by_name[action.pod]
        if p.endpoint:
            try:
                await rt.engines.drain(p.endpoint)  # readiness drops; requests in flight finish
                await rt.engines.release(p.endpoint)
            except EngineError as e:
                if e.status == 409:
                    return  # requests still in flight: try again next round
                log.warning("%s", e)
        try:
            await rt.kube.patch_pod(ns, p.pod_name, unbind_patch(p))
        except (Conflict, NotFound):
            return
        await rt.kube.event(ns, body, "ModelService", "Normal", "Released", f"{p.pod_name} returned to the pool")


def _slim_pod(body: Any) -> dict[str, Any]:
    """What the operator reads of a pool pod (the index holds hundreds of them)."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations", "resourceVersion",
                                               "deletionTimestamp", "uid") if k in meta},
            "spec": {"nodeName": spec.get("nodeName"),
                     "containers": [{"name": c.get("name"), "ports": list(c.get("ports") or [])}
                                    for c in spec.get("containers") or []]},
            "status": {"podIP": status.get("podIP"), "conditions": list(status.get("conditions") or [])}}


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    reg = kopf.OperatorRegistry()
    op_settings = settings  # kopf passes its own `settings` to the startup handler
    ms = dict(group=GROUP, version=VERSION, plural="modelservices", registry=reg)
    splan = dict(group=GROUP, version=VERSION, plural="scaleplans", registry=reg)

    @kopf.on.startup(registry=reg)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = L.FINALIZER
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 60
        s = op_settings
        kube = await Kube.connect()
        token = s.engine_token or "unset"
        if not s.engine_token:
            for ns in s.namespaces or ["default"]:
                token = await kube.secret_value(ns, s.engine_token_secret) or token
        om = OperatorMetrics()
        if s.metrics_port:
            om.serve(s.metrics_port)
        memo.rt = Runtime(s, kube, EngineClient(token, s.engine_timeout_seconds),
                          None if s.metrics_source == "prometheus" else Scraper(s.scrape_timeout_seconds,
                                                                             window_s=s.rate_window_seconds),
                          PrometheusSource(s.prometheus_url) if s.metrics_source == "prometheus" and s.prometheus_url
                          else None, om)
        if s.router_url:  # demand when no engine exists (scale from zero), and status.url
            memo.rt.router = RouterDemand(s.router_url, s.scrape_timeout_seconds, max_age_s=s.interval_seconds / 2)

    @kopf.on.login(registry=reg)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # a custom registry has no default login handlers: in-cluster service account, else KUBECONFIG
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup(registry=reg)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "rt", None):
            await memo.rt.close()

    # Watch-fed state (kopf indexes): reconcile rounds read pods, plans and nodes from memory, not from
    # the API server; kopf fills the indexes before any other handler runs.
    # (explicit ids: kopf passes each index to handlers as a kwarg named by its id)
    @kopf.index("pods", labels={L.POOL: kopf.PRESENT}, registry=reg, id="pool_pods")
    def pool_pods(namespace: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        return {namespace: _slim_pod(body)}

    @kopf.index(**splan, id="scaleplans")
    def scaleplans(namespace: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        return {namespace: {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
                            "status": dict(body.get("status") or {})}}

    @kopf.index("nodes", registry=reg, id="gpu_nodes")
    def gpu_nodes(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        meta, status = body["metadata"], body.get("status") or {}
        return {ALL: {"metadata": {"name": meta["name"], "labels": dict(meta.get("labels") or {})},
                      "status": {"allocatable": dict(status.get("allocatable") or {}),
                                 "capacity": dict(status.get("capacity") or {})}}}

    def rt_of(memo: kopf.Memo, kw: dict[str, Any]) -> Runtime:
        rt: Runtime = memo.rt
        if rt.pod_index is None:
            if "pool_pods" not in kw:
                raise kopf.PermanentError("kopf did not pass the pool_pods index; handlers cannot read state")
            rt.attach(kw["pool_pods"], kw["scaleplans"], kw["gpu_nodes"])
        return rt

    @kopf.on.resume(**ms)
    @kopf.on.create(**ms)
    @kopf.on.update(**ms)
    async def on_service(body: kopf.Body, memo: kopf.Memo, reason: str, **kw: Any) -> None:
        await reconcile_service(rt_of(memo, kw), dict(body), str(reason))

    @kopf.timer(**ms, interval=settings.interval_seconds, sharp=True)
    async def on_tick(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        await reconcile_service(rt_of(memo, kw), dict(body), "timer")

    @kopf.on.delete(**ms)
    async def on_delete(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        await plandriver.release_all(rt_of(memo, kw), dict(body))

    @kopf.daemon(**splan, cancellation_timeout=2.0,
                 when=lambda status, **_: (status or {}).get("phase") not in TERMINAL)
    async def drive_plan(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kw: Any) -> None:
        await plandriver.drive(rt_of(memo, kw), dict(body), stopped)

    return reg
