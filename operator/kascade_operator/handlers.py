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

import contextlib
import dataclasses
import logging
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kascade_operator import converter, enginetoken, hostcopykeeper, plandriver, rolesync, rounds, serving_gate
from kascade_operator import labels as L
from kascade_operator.actuator import apply
from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleDecision, RoleInput, decide_roles
from kascade_operator.demand import RouterDemand, zero_rule
from kascade_operator.engine_client import EngineClient
from kascade_operator.kube import GROUP, VERSION, Kube, NotFound, now_iso
from kascade_operator.metrics import PrometheusSource, Scraper, snapshot
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.podtemplate import checkpoint_path
from kascade_operator.pool import PodView, service_key
from kascade_operator.reconcile import (
    TERMINAL,
    CreatePlan,
    Drain,
    PlanView,
    Result,
    reconcile,
    role_bounds,
    role_want,
)
from kascade_operator.runtime import ALL, Runtime

__all__ = ["apply", "build_registry", "reconcile_service"]  # apply: the act step (actuator.py)
from kascade_operator.settings import OperatorSettings
from kascade_operator.sourcehealth import source_blocker
from kascade_operator.status import Blocker, invalid_status, keep_transition_times, service_status
from kascade_operator.validation import semantic_errors
from kascade_planner import policies as P
from kascade_planner.engine_tls import engine_tls_context

log = logging.getLogger(__name__)


def field_errors(e: ValidationError) -> str:
    """'spec.replicas.colocated.min: Input should be ...; ...' — the field path the user must fix."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in ("spec", *err["loc"]))
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


MAX_NAME = 63  # the name is a label value on pods and ScalePlans (kascade.io/model-service)


def _active_plan_ages(raw_plans: list[dict[str, Any]], service: str) -> list[float]:
    """Seconds since creation of the service's unfinished ScalePlans (for the scale-up-stuck alert)."""
    now = datetime.now(UTC)
    return [(now - datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))).total_seconds()
            for p in raw_plans if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == service
            and (p.get("status") or {}).get("phase") not in TERMINAL and p["metadata"].get("creationTimestamp")]


def held_pods(sp: dict[str, Any]) -> list[dict[str, Any]]:
    """A ScalePlan's targets and its host-copy sources (idle pods it sends from): no other plan binds them."""
    spec = sp.get("spec") or {}
    return [*(spec.get("targets") or []), *(s for s in spec.get("sources") or [] if s.get("hostCopy") and s.get("pod"))]


def plan_view(sp: dict[str, Any]) -> PlanView:
    spec, st = sp.get("spec") or {}, sp.get("status") or {}
    return PlanView(sp["metadata"]["name"], spec.get("role", ""), st.get("phase") or "",
                    tuple(t.get("pod") or t["instance"] for t in spec.get("targets") or []))


async def observe(rt: Runtime, pool_ns: str, ns: str) -> tuple[list[PodView], list[dict[str, Any]]]:
    leaf, _ = await rt.node_facts()
    pods = rt.pod_views(await rt.pool_pods(pool_ns), leaf)
    # a draining pod is "drained" when release succeeds; try it every round (409 = still in flight)
    pods = [replace(p, drained=True) if p.draining else p for p in pods]
    return pods, await rt.scaleplans(ns)


async def reconcile_service(rt: Runtime, body: dict[str, Any], trigger: str) -> Result | None:
    # kopf runs timers and change handlers of one object concurrently: one reconcile at a time per
    # ModelService, or two rounds would both see "no plan yet" and create two ScalePlans.
    meta = body["metadata"]
    async with rt.lock(meta["namespace"], "modelservice/" + meta["name"]):
        return await _reconcile_service(rt, body, trigger)


async def _refuse(rt: Runtime, body: dict[str, Any], problems: list[str]) -> None:
    meta = body["metadata"]
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    msg = "; ".join(problems)
    if rt.invalid_seen.get((ns, name)) != gen:
        rt.invalid_seen[(ns, name)] = gen or 0
        await rt.event(ns, body, "ModelService", "Warning", "InvalidSpec", msg)
        await rt.kube.patch_modelservice_status(ns, name, invalid_status(msg, gen))


async def _reconcile_service(rt: Runtime, body: dict[str, Any], trigger: str) -> Result | None:
    t0 = time.perf_counter()
    meta = body["metadata"]
    ns, name, gen = meta["namespace"], meta["name"], meta.get("generation")
    if meta.get("deletionTimestamp"):
        return None  # being deleted: the delete handler releases everything; nothing new is started
    problems: list[str] = []
    if len(name) > MAX_NAME:
        problems.append(f"metadata.name: {len(name)} characters; at most {MAX_NAME} (it is a label value on the "
                        f"service's pods and ScalePlans)")
    try:
        spec = ModelServiceSpec.model_validate(body.get("spec") or {})
        problems += semantic_errors(spec, (await rt.node_facts())[1], rt.settings.gpu_resource)
    except ValidationError as e:
        problems.append(field_errors(e))
    if problems:
        await _refuse(rt, body, problems)
        rt.steady[(ns, name)] = (rt.settings.interval_seconds, True)  # a spec change (kopf update) retries
        return None
    rt.invalid_seen.pop((ns, name), None)
    # per-role scale handles (ModelServiceRole: HPA/KEDA per role) set the roles' desired counts
    handles = await rolesync.RoleHandles.read(rt, ns, name, spec.mode)
    spec, role_sources = handles.apply(spec)
    interval = spec.scaling.interval_seconds if spec.scaling else 1.0
    now = time.monotonic()
    if trigger == "timer" and now - rt.last_round.get((ns, name), -1e9) < interval * 0.95:
        return None  # this service's own spec.scaling.intervalSeconds: the timer ticks at the operator's
    rt.last_round[(ns, name)] = now
    pool_ns = rt.pool_namespace(ns)
    key = service_key(ns, name, pool_ns)
    pods, raw_plans = await observe(rt, pool_ns, ns)
    plans = [plan_view(p) for p in raw_plans if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == name]
    rt.metrics.pool_size.labels(pool_ns).set(sum(1 for p in pods if p.model_service is None))

    inputs: list[RoleInput] = []
    for role, b in role_bounds(spec).items():
        serving = [p for p in pods if p.model_service == key and p.role == role and not p.draining]
        rkey = (ns, name, role)
        if role_want(spec, role, b) is not None:
            snap = P.MetricsSnapshot(now)  # the policy is off for this role: no scrape
        elif rt.prometheus is not None:
            snap = snapshot(await rt.prometheus.collect([p.pod_name for p in serving if p.ready]), now)
        else:
            assert rt.scraper is not None
            ready = {p.instance: p.endpoint for p in serving if p.ready and p.endpoint}
            # the shared sweep's view (no HTTP when fresh); without one (rounds driven directly) a scrape now
            loads = await (rt.view.collect(ready, rkey) if rt.view is not None else rt.scraper.collect(ready, rkey))
            snap = snapshot(loads, now)
        inputs.append(RoleInput(role, len(serving), b.min, b.max, snap, rt.below_since.get(rkey)))
    rnd = decide_roles(spec, inputs, trigger, sources=role_sources)
    await converter.sync(rt, body, spec, key, pods, inputs)  # disaggregated: convertible decoders (TokenScale)
    bounds = role_bounds(spec)
    desired = dict(rnd.desired)
    release_last: set[str] = set()
    decisions: list[RoleDecision] = []
    for d, inp in zip(rnd.decisions, inputs, strict=True):
        rt.below_since[(ns, name, d.role)] = d.state.below_since_s
        if role_want(spec, d.role, bounds[d.role]) is None:
            # scale from zero on the router's demand, to zero after an idle time (min 0)
            d, may_release_last = await _zero(rt, spec, (ns, name, d.role), inp.serving, inp.lo, inp.snap, d)
            if may_release_last:
                release_last.add(d.role)
            if trigger == "timer" or d.desired != d.current or d.role in desired:
                desired[d.role] = d.desired  # the zero rule overrides the policy's wish, also back to current
        decisions.append(d)
    last = None
    changes = [d for d in decisions if d.desired != d.current]
    for d in changes:
        rt.metrics.decisions.labels(ns, name, d.role, d.policy, "up" if d.desired > d.current else "down").inc()
        log.info("%s/%s decision %s %d -> %d: %s", ns, name, d.role, d.current, d.desired, d.reason)
        last = {"time": now_iso(), "policy": d.policy, "role": d.role, "from": d.current, "to": d.desired,
                "reason": d.reason[:1024], "metrics": {k: float(v) for k, v in d.metrics.items()}}
    # targets other services' plans hold (their binds may not be in the pod index yet), claimed pods
    # included; choosing and claiming happen with no await in between, so two services never pick one pod
    # and the host-copy pods they send from (binding one mid-plan would drop the copy it sends)
    others = {t.get("pod") or t["instance"] for p in raw_plans
              if (p.get("status") or {}).get("phase") not in TERMINAL for t in held_pods(p)}
    if pool_ns != ns:  # the pool is shared across namespaces: plans elsewhere hold targets too
        others |= {t.get("pod") or t["instance"] for n2 in rt.plan_namespaces() if n2 != ns
                   for p in await rt.scaleplans(n2) if (p.get("status") or {}).get("phase") not in TERMINAL
                   for t in held_pods(p)}
    expected = rt.expected(pool_ns, key, (p.pod_name for p in pods))
    res = reconcile(key, spec, pods, plans, desired or None, "; ".join(d.reason for d in changes),
                    others | rt.reserved(pool_ns), expected, release_last)
    rt.metrics.observe_service(ns, name, res.roles, _active_plan_ages(raw_plans, name))
    for action in res.actions:
        if isinstance(action, CreatePlan):
            rt.reserve(pool_ns, (*action.targets, *action.sources))  # idle host-copy sources too (held_pods)
    decided_at = time.perf_counter()
    blocker: Blocker | None = None
    for action in res.actions:
        blocker = await apply(rt, body, spec, pods, action, decided_at) or blocker
    # never zero host copies of the model while it is served: ask one serving engine when the pool keeps none
    # (the pods this round drained count as draining: their releases keep one, next round)
    drains = {a.pod for a in res.actions if isinstance(a, Drain)}
    asked = await hostcopykeeper.ensure(rt, body, spec.model.name, key,
                                        [replace(p, draining=True) if p.pod_name in drains else p for p in pods],
                                        pool_ns)
    # steady: nothing moves until an input changes, so the next round waits for a change or the resync. A
    # scale-down delay counting at min holds nothing back (min is never undercut); at min 0 the idle clock does.
    moving = {
        "actions": bool(res.actions), "changes": bool(changes), "progressing": res.progressing,
        "short": bool(res.short), "hostCopyAsked": asked is not None, "noSweep": rt.view is None,
        "releaseLast": bool(release_last), "draining": any(p.model_service == key and p.draining for p in pods),
        "scaleDownDelay": any(rt.below_since.get((ns, name, i.role)) is not None and i.serving > i.lo
                              for i in inputs),
        "minZero": any(b.min < 1 for b in bounds.values()),
    }
    rt.steady[(ns, name)] = (interval, not any(moving.values()))
    log.debug("%s/%s round: %s", ns, name, ", ".join(k for k, v in moving.items() if v) or "steady")
    await serving_gate.sync(rt.kube, pool_ns, await rt.pool_pods(pool_ns))  # readiness gate follows the binding
    # a source the engines cannot fetch (an hf:// download failed) is the cause to show first
    blocker = source_blocker(raw_plans, name, checkpoint_path(spec)) or blocker
    status = service_status(key, name, res, pods, plans, gen, blocker, spec.model.name)
    if rt.settings.router_url:
        status["url"] = rt.settings.router_url.rstrip("/") + "/v1"
    if last:
        status["lastDecision"] = last
    old = body.get("status") or {}
    status["conditions"] = keep_transition_times(status["conditions"], old.get("conditions") or [])
    if any(old.get(k) != v for k, v in status.items()):
        # unchanged status is not written: at a sub-second interval every write is a watch event for
        # every ModelService watcher, and the API server is the record, not the fast path
        await rt.kube.patch_modelservice_status(ns, name, status)
    await handles.write(rt, ns, spec, status["selector"], res.roles)
    await prune_history(rt, ns, name, raw_plans, spec.scale_plan_history_limit)
    rt.metrics.reconcile.labels(trigger).observe(time.perf_counter() - t0)
    return res


async def _zero(rt: Runtime, spec: ModelServiceSpec, key: tuple[str, str, str], current: int, lo: int,
                snap: Any, d: RoleDecision) -> tuple[RoleDecision, bool]:
    """Scale from zero on the router's demand (no engine exists to be scraped) and to zero after an idle
    time with min 0; otherwise the policy's decision stands."""
    now = time.monotonic()
    dem = await rt.router.get(key[0], key[1]) if rt.router is not None else None
    if (
        snap.in_flight > 0
        or snap.output_tokens_per_s > 0
        or (dem is not None and (dem.active or dem.requests_per_s > 0))
        or key not in rt.last_busy
    ):
        rt.last_busy[key] = now
    idle = now - rt.last_busy[key]
    if dem is not None and dem.idle_s is not None:
        idle = min(idle, dem.idle_s)
    after = spec.scaling.idle_release_seconds if spec.scaling else 300.0
    want, why, release_last = zero_rule(current, lo, d.desired, dem, idle, after, router=rt.router is not None)
    if want != d.desired or why:
        d = dataclasses.replace(d, desired=want, reason=why or d.reason)
    return d, release_last


async def prune_history(rt: Runtime, ns: str, name: str, raw_plans: list[dict[str, Any]], limit: int) -> None:
    """Keep at most `limit` finished ScalePlans per service (spec.scalePlanHistoryLimit), oldest deleted."""
    done = [p for p in raw_plans if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == name
            and (p.get("status") or {}).get("phase") in TERMINAL]
    if len(done) <= limit:
        return
    done.sort(key=lambda p: ((p.get("status") or {}).get("completionTime") or "",
                             p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
    for p in done[:len(done) - limit]:
        with contextlib.suppress(NotFound):
            await rt.kube.delete_scaleplan(ns, p["metadata"]["name"])


async def queued_round(rt: Runtime, key: Any) -> None:
    """A round the work queue asked for (rounds.py): the service as the watch last showed it."""
    ns, name = key
    body = next(iter((rt.service_index or {}).get(key, ())), None)
    if body is None:
        rounds.forget(rt, ns, name)  # deleted (or not ours any more)
        return
    await reconcile_service(rt, body, "timer")  # raising: the queue retries it with backoff
    rounds.after_round(rt, ns, name)


def _slim_pod(body: Any) -> dict[str, Any]:
    """What the operator reads of a pool pod (the index holds hundreds of them)."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations", "resourceVersion",
                                               "deletionTimestamp", "uid") if k in meta},
            "spec": {"nodeName": spec.get("nodeName"), "readinessGates": list(spec.get("readinessGates") or []),
                     "containers": [{"name": c.get("name"), "ports": list(c.get("ports") or [])}
                                    for c in spec.get("containers") or []]},
            "status": {"podIP": status.get("podIP"), "phase": status.get("phase"),
                       "conditions": list(status.get("conditions") or []),
                       "containerStatuses": [{"name": c.get("name"), "started": c.get("started")}
                                             for c in status.get("containerStatuses") or []]}}


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    reg = kopf.OperatorRegistry()
    op_settings = settings  # kopf passes its own `settings` to the startup handler
    ms = dict(group=GROUP, version=VERSION, plural="modelservices", registry=reg)
    splan = dict(group=GROUP, version=VERSION, plural="scaleplans", registry=reg)
    mrole = dict(group=GROUP, version=VERSION, plural="modelserviceroles", registry=reg)

    @kopf.on.startup(registry=reg)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = L.FINALIZER
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 60
        s = op_settings
        kube = await Kube.connect()
        # the CLI resolves the token before kopf starts (a clear exit when it cannot); others get it here
        token = s.engine_token or await enginetoken.ensure(kube, enginetoken.token_namespace(s.engine_token_namespace),
                                                           s.engine_token_secret, s.engine_token_create)
        om = OperatorMetrics()
        if s.metrics_port:
            om.serve(s.metrics_port)
        engine_tls = engine_tls_context(s.engine_ca_file)  # HTTPS to engines started with TLS files
        memo.rt = Runtime(s, kube, EngineClient(token, s.engine_timeout_seconds, tls=engine_tls),
                          None if s.metrics_source == "prometheus" else Scraper(s.scrape_timeout_seconds,
                                                                             window_s=s.rate_window_seconds,
                                                                             tls=engine_tls),
                          PrometheusSource(s.prometheus_url) if s.metrics_source == "prometheus" and s.prometheus_url
                          else None, om)
        if s.router_url:  # demand when no engine exists (scale from zero), and status.url
            memo.rt.router = RouterDemand(s.router_demand_url or s.router_url, s.scrape_timeout_seconds,
                                          max_age_s=s.interval_seconds / 2)  # summed over every router replica

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
    # Every round after a service's first comes from the work queue (rounds.py); these indexers, which see
    # every change of a pool pod and a ScalePlan anyway, wake the service a bound pod or a plan belongs to
    # (kopf handlers per event would cost a handler invocation and an INFO line each).
    @kopf.index("pods", labels={L.POOL: kopf.PRESENT}, registry=reg, id="pool_pods")
    def pool_pods(namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
        svc = (body["metadata"].get("labels") or {}).get(L.MODEL_SERVICE)
        if svc and getattr(memo, "rt", None) is not None:
            rounds.wake(memo.rt, (body["metadata"].get("annotations") or {}).get(L.SERVICE_NS) or namespace, svc)
        return {namespace: _slim_pod(body)}

    @kopf.index(**splan, id="scaleplans")
    def scaleplans(namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
        ref = ((body.get("spec") or {}).get("modelServiceRef") or {}).get("name")
        if ref and getattr(memo, "rt", None) is not None:
            rounds.wake(memo.rt, namespace, ref)
        return {namespace: {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
                            "status": dict(body.get("status") or {})}}

    @kopf.index("nodes", registry=reg, id="gpu_nodes")
    def gpu_nodes(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        meta, status = body["metadata"], body.get("status") or {}
        return {ALL: {"metadata": {"name": meta["name"], "labels": dict(meta.get("labels") or {})},
                      "status": {"allocatable": dict(status.get("allocatable") or {}),
                                 "capacity": dict(status.get("capacity") or {})}}}

    @kopf.index(**ms, id="modelservices")
    def modelservices(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): dict(body)}  # what a queued round reconciles

    @kopf.index(**mrole, id="role_objects")
    def role_objects(namespace: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        return {namespace: {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
                            "status": dict(body.get("status") or {})}}

    def rt_of(memo: kopf.Memo, kw: dict[str, Any]) -> Runtime:
        rt: Runtime = memo.rt
        if rt.pod_index is None:
            if "pool_pods" not in kw:
                raise kopf.PermanentError("kopf did not pass the pool_pods index; handlers cannot read state")
            rt.attach(kw["pool_pods"], kw["scaleplans"], kw["gpu_nodes"], kw.get("role_objects"))
            rt.service_index = kw.get("modelservices")
            rounds.start(rt, lambda key: queued_round(rt, key))  # the indexes the rounds read are filled now
        return rt

    @kopf.on.resume(**mrole)
    @kopf.on.create(**mrole)
    @kopf.on.update(**mrole)
    async def on_role_object(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        rt = rt_of(memo, kw)
        await rolesync.orphan(rt, dict(body))  # one whose ModelService exists: its rounds
        ref = ((body.get("spec") or {}).get("modelServiceRef") or {}).get("name")
        if ref:
            rounds.wake(rt, body["metadata"]["namespace"], ref)

    @kopf.on.resume(**ms)
    @kopf.on.create(**ms)
    @kopf.on.update(**ms)
    async def on_service(body: kopf.Body, memo: kopf.Memo, reason: str, **kw: Any) -> None:
        rt = rt_of(memo, kw)
        try:
            await reconcile_service(rt, dict(body), str(reason))
        finally:
            rounds.after_round(rt, body["metadata"]["namespace"], body["metadata"]["name"])

    @kopf.on.delete(**ms)
    async def on_delete(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        rt = rt_of(memo, kw)
        async with rt.lock(body["metadata"]["namespace"], "modelservice/" + body["metadata"]["name"]):
            await plandriver.release_all(rt, dict(body))
        rounds.forget(rt, body["metadata"]["namespace"], body["metadata"]["name"])

    # a plan's daemon stops when its phase turns terminal: signalled first (the driver returns on its own
    # within one poll), cancelled only after cancellation_backoff
    @kopf.daemon(**splan, cancellation_backoff=5.0, cancellation_timeout=2.0,
                 when=lambda status, **_: (status or {}).get("phase") not in TERMINAL)
    async def drive_plan(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kw: Any) -> None:
        await plandriver.drive(rt_of(memo, kw), dict(body), stopped)

    return reg
