"""Thin kopf handlers: each hands its event to a round or to the plan driver; nothing else lives here.

Data flow:
- ModelService create/update/resume, and every round the work queue asks for (rounds.py: a pod, a plan, a
  metric or the spec changed, or the resync is due) -> `reconcile_service`: one round,
  observe (observe.py: every read, into a frozen World) -> decide (decision.py: pure) -> act (actuator.py:
  every write). The whole round:

      world = await observe(rt, body, trigger)      # reads: spec, pods, plans, metrics, demand, claims
      decision = decide(world)                      # pure: policy, reconcile, conversions, status, ...
      await act(rt, world, decision)                # writes: plans, pods, engines, status, memory

- ScalePlan daemon (`drive_plan`, one per non-terminal ScalePlan; kopf restarts it after an operator
  restart) -> `plandriver.drive`: bind targets, instruct engines once, write throttled progress.
- ModelService delete (finalizer) -> drain and release every bound pod, so the pool gets them back.
Handlers keep no state of their own; everything lives in `Runtime` (kopf memo) or in the API server.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import kopf

from kascade_operator import enginetoken, memtrace, plandriver, rolesync, rounds, shardhooks, trace
from kascade_operator import labels as L
from kascade_operator.actuator import act, apply
from kascade_operator.decision import decide
from kascade_operator.demand import RouterDemand
from kascade_operator.engine_client import EngineClient
from kascade_operator.kube import GROUP, VERSION, Kube
from kascade_operator.metrics import PrometheusSource, Scraper
from kascade_operator.observe import field_errors, observe
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.reconcile import TERMINAL, Result
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings
from kascade_operator.shardset import ShardSet
from kascade_operator.snapshots import held_pods
from kascade_planner.engine_tls import engine_tls_context

__all__ = ["act", "apply", "build_registry", "decide", "field_errors", "held_pods", "observe", "reconcile_service"]

log = logging.getLogger(__name__)


async def reconcile_service(rt: Runtime, body: dict[str, Any], trigger: str, limit: bool = True) -> Result | None:
    """One round of one ModelService: observe -> decide -> act. kopf runs change handlers while the queue
    runs rounds: one round at a time per ModelService, or two rounds would both see "no plan yet" and
    create two ScalePlans."""
    meta = body["metadata"]
    lock = rt.lock(meta["namespace"], "modelservice/" + meta["name"])
    async with lock, shardhooks.held(rt, meta["namespace"]) as ok:
        if not ok:  # another shard's (given back while this round waited)
            return None
        t0 = time.perf_counter()
        world = await observe(rt, body, trigger, limit)
        if world is None:
            return None
        decision = decide(world)
        if decision.actions:
            trace.event("decided", (meta["namespace"], meta["name"]),
                        ",".join(type(a).__name__ for a in decision.actions))
        await act(rt, world, decision)
        if decision.result is not None:
            rt.metrics.reconcile.labels(trigger).observe(time.perf_counter() - t0)
        return decision.result


async def service_changed(rt: Runtime, body: dict[str, Any], reason: str) -> None:
    """kopf's create / update / resume of a ModelService. A change runs its round now (the queue's workers leave
    the service meanwhile); a resume (the operator starting, once per service) is queued instead: the queue's
    bounded workers take them in turn. Run inline, 1,000 services' resumes were 1,000 rounds at once, each
    scraping its engines: a fresh operator at 10,000 nodes took 300 s until every service had had a round."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if not rt.owns(ns):
        return  # another shard's: its holder runs it (shardhooks.py)
    if reason == "resume" and rt.queue is not None:
        rounds.wake(rt, ns, name)
        return
    try:
        with rounds.held(rt, ns, name):  # no worker waits on it
            await reconcile_service(rt, body, reason)
    finally:
        rounds.after_round(rt, ns, name)


async def queued_round(rt: Runtime, key: Any) -> None:
    """A round the work queue asked for (rounds.py): the service as the watch last showed it."""
    ns, name = key
    body = next(iter((rt.service_index or {}).get(key, ())), None)
    if body is None or not rt.owns(ns):
        rounds.forget(rt, ns, name)  # deleted (or not ours any more: another shard's)
        return
    woken = key in rt.metric_woken  # its loads changed: not skipped by the 0.95-interval rate limit
    rt.metric_woken.discard(key)
    trace.event("start", key)
    await reconcile_service(rt, body, "timer", limit=not woken)  # raising: the queue retries it with backoff
    rounds.after_round(rt, ns, name)


DROPPED_META = ("managedFields",)  # server-side bookkeeping no round reads: most of a small object's bytes
DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)  # a copy of the whole object


def slim_meta(metadata: Any) -> dict[str, Any]:
    """Object metadata without its managedFields and kubectl's last-applied copy, which would double or triple
    what each index entry holds."""
    meta = {k: v for k, v in (metadata or {}).items() if k not in DROPPED_META}
    ann = meta.get("annotations")
    if ann and any(k in ann for k in DROPPED_ANNOTATIONS):
        meta["annotations"] = {k: v for k, v in ann.items() if k not in DROPPED_ANNOTATIONS}
    return meta


def index_entry(body: Any) -> dict[str, Any]:
    """A watched object as the indexes keep it (ScalePlans, ModelServices, roles): the whole object, slim_meta."""
    return {**dict(body), "metadata": slim_meta(body.get("metadata"))}


def _slim_pod(body: Any) -> dict[str, Any]:
    """What the operator reads of a pool pod (the index holds hundreds of them)."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    return {"metadata": slim_meta({k: meta[k] for k in ("name", "namespace", "labels", "annotations", "resourceVersion",
                                                         "deletionTimestamp", "uid") if k in meta}),
            "spec": {"nodeName": spec.get("nodeName"), "readinessGates": list(spec.get("readinessGates") or []),
                     "containers": [{"name": c.get("name"), "ports": list(c.get("ports") or [])}
                                    for c in spec.get("containers") or []]},
            "status": {"podIP": status.get("podIP"), "phase": status.get("phase"),
                       "conditions": list(status.get("conditions") or []),
                       "containerStatuses": [{"name": c.get("name"), "started": c.get("started")}
                                             for c in status.get("containerStatuses") or []]}}


def build_registry(settings: OperatorSettings, shards: ShardSet | None = None) -> kopf.OperatorRegistry:
    """`shards`: the shards this replica holds (settings.shards > 1, shardlead.py); None: every service."""
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
        memtrace.start_from_env(os.environ)  # opt-in diagnostics (KASCADE_MEMTRACE_DUMP)
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
        memo.rt.shards = shards
        if shards is not None:
            settings.persistence.diffbase_storage = shardhooks.OwnedDiffBase(memo.rt.owns)
            settings.persistence.progress_storage = shardhooks.OwnedProgress(memo.rt.owns)
            shards.on_hold(lambda k: shardhooks.wake_shard(memo.rt, k))
        memo.rt.watch_nodes()  # the nodes by list + watch, not a kopf index (nodefacts.py: start-up cost)
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

    # Watch-fed state (kopf indexes): reconcile rounds read pods and plans from memory, not from the API
    # server; kopf fills the indexes before any other handler runs. Nodes are not a kopf index: kopf's
    # readiness gate costs O(objects^2) at start-up, minutes at 2,000 nodes (Runtime.watch_nodes instead).
    # (explicit ids: kopf passes each index to handlers as a kwarg named by its id)
    # Every round after a service's first comes from the work queue (rounds.py); these indexers, which see
    # every change of a pool pod and a ScalePlan anyway, wake the service a bound pod or a plan belongs to
    # (kopf handlers per event would cost a handler invocation and an INFO line each).
    # The indexers are coroutines: kopf runs a plain function in its thread pool, a thread hop per watch
    # event (2,000 nodes' status updates), and rounds.wake would then touch the queue from another thread.
    @kopf.index("pods", labels={L.POOL: kopf.PRESENT}, registry=reg, id="pool_pods")
    async def pool_pods(namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
        svc = (body["metadata"].get("labels") or {}).get(L.MODEL_SERVICE)
        if svc and getattr(memo, "rt", None) is not None:
            rounds.wake(memo.rt, (body["metadata"].get("annotations") or {}).get(L.SERVICE_NS) or namespace, svc)
        return {namespace: _slim_pod(body)}

    @kopf.index(**splan, id="scaleplans")
    async def scaleplans(namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, dict[str, Any]]:
        ref = ((body.get("spec") or {}).get("modelServiceRef") or {}).get("name")
        if ref and getattr(memo, "rt", None) is not None:
            rounds.wake(memo.rt, namespace, ref)
        return {namespace: {"metadata": slim_meta(body.get("metadata")), "spec": dict(body.get("spec") or {}),
                            "status": dict(body.get("status") or {})}}

    @kopf.index(**ms, id="modelservices")
    async def modelservices(namespace: str, name: str, body: kopf.Body,
                            **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): index_entry(body)}  # what a queued round reconciles

    @kopf.index(**mrole, id="role_objects")
    async def role_objects(namespace: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
        return {namespace: {"metadata": slim_meta(body.get("metadata")), "spec": dict(body.get("spec") or {}),
                            "status": dict(body.get("status") or {})}}

    def rt_of(memo: kopf.Memo, kw: dict[str, Any]) -> Runtime:
        rt: Runtime = memo.rt
        if rt.pod_index is None:
            if "pool_pods" not in kw:
                raise kopf.PermanentError("kopf did not pass the pool_pods index; handlers cannot read state")
            rt.attach(kw["pool_pods"], kw["scaleplans"], kw.get("role_objects"))
            rt.service_index = kw.get("modelservices")
            rounds.start(rt, lambda key: queued_round(rt, key))  # the indexes the rounds read are filled now
        return rt

    @kopf.on.resume(**mrole)
    @kopf.on.create(**mrole)
    @kopf.on.update(**mrole)
    async def on_role_object(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        rt = rt_of(memo, kw)
        if not rt.owns(body["metadata"]["namespace"]):
            return
        await rolesync.orphan(rt, dict(body))  # one whose ModelService exists: its rounds
        ref = ((body.get("spec") or {}).get("modelServiceRef") or {}).get("name")
        if ref:
            rounds.wake(rt, body["metadata"]["namespace"], ref)

    @kopf.on.resume(**ms)
    @kopf.on.create(**ms)
    @kopf.on.update(**ms)
    async def on_service(body: kopf.Body, memo: kopf.Memo, reason: str, **kw: Any) -> None:
        await service_changed(rt_of(memo, kw), dict(body), str(reason))

    @kopf.on.delete(**ms, when=shardhooks.claims)
    async def on_delete(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        rt = rt_of(memo, kw)
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        await shardhooks.delete_guard(rt, ns)
        with rounds.held(rt, ns, name):
            async with rt.lock(ns, "modelservice/" + name), shardhooks.held(rt, ns) as ok:
                if not ok:  # given back while the lock was awaited: kopf retries, and delete_guard decides again
                    raise kopf.TemporaryError("the service's shard was given back before its pods were released",
                                              delay=rt.settings.lease_retry_seconds)
                # counted as running (ShardSet.busy): a shard is given back only once the release is done
                await plandriver.release_all(rt, dict(body))
        rounds.forget(rt, ns, name)

    # a plan's daemon stops when its phase turns terminal: signalled first (the driver returns on its own
    # within one poll), cancelled only after cancellation_backoff
    @kopf.daemon(**splan, cancellation_backoff=5.0, cancellation_timeout=2.0,
                 when=lambda status, **kw: (status or {}).get("phase") not in TERMINAL and shardhooks.claims(**kw))
    async def drive_plan(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kw: Any) -> None:
        await shardhooks.drive_owned(rt_of(memo, kw), dict(body), stopped, plandriver.drive)

    return reg
