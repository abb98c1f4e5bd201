"""Drives one ScalePlan from creation to Succeeded/Failed: bind targets, instruct every participant
exactly once, track progress, mark loaded pods, finish the ModelService's scale-up.

Data flow: `new_scaleplan` (CreatePlan -> planner -> ScalePlan body with an ownerReference to the
ModelService) -> `start` (fast path, right after creation) and `drive` (kopf daemon; also what runs
after an operator restart) -> `instruction.instruct_pending` under a per-plan lock (each participant told
exactly once, across restarts too) -> engine statuses each round -> lost targets dropped, progress ->
throttled ScalePlan status -> `_finish` (pods marked loaded, Event, terminal status). `release_all` undoes
a ModelService's bindings when it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from kascade_operator import labels as L
from kascade_operator import livewiring
from kascade_operator import scaleplan as SP
from kascade_operator.api import ModelServiceSpec
from kascade_operator.engine_client import EngineError
from kascade_operator.instruction import Manifests, instruct_pending, label_bound, patch_guarded, plan_pool
from kascade_operator.kube import GROUP, VERSION, Conflict, NotFound, now_iso
from kascade_operator.podtemplate import checkpoint_path
from kascade_operator.pool import PodView, pod_view, service_key, unbind_patch
from kascade_operator.reconcile import CreatePlan
from kascade_operator.runtime import Runtime
from kascade_operator.status import keep_transition_times, plan_conditions

log = logging.getLogger(__name__)

POLL_S = 0.2
NODE_COPY_RETRY_S = 300.0  # a node whose engine refused source.nodeCopy: its targets stream this long
UNREACHABLE_LIMIT_S = 5.0  # an instructed target whose engine stays unreachable this long fails the plan
LABEL_LIMIT_S = 20.0  # an instructed target whose pod the watch never shows bound: re-read, relabel or drop


async def source_manifest(rt: Runtime, sources: list[PodView], seen: Manifests | None = None) -> dict[str, Any] | None:
    """The block manifest of the first source engine that offers one (real block ids and sizes). `seen`: every
    answer read on the way is recorded in it (endpoint -> manifest, None: that engine offers none), for the
    instruct of the plan built on it (instruction.py: the same GET, not asked again)."""
    for p in sources:
        if p.endpoint:
            try:
                m = await rt.engines.manifest(p.endpoint)
            except EngineError as e:
                log.warning("manifest of %s: %s", p.pod_name, e)
                continue
            if seen is not None:
                seen[p.endpoint] = m
            if m:
                return m
    return None


def plans_live(spec: ModelServiceSpec) -> bool:
    """Whether the service's ScalePlans pair loading targets live (`spec.scaling.live`), at any tp: a TP target
    loading by plan installs each block on all its ranks as soon as every rank holds its share (engine
    tp/progressive.py), so it serves its resident prefix with its pair while it loads, as a TP-1 target does
    (docs/tp.md). Execution pipelines stay TP-1 only (scaleplan.py `build`): a TP engine as a pipeline hop is
    untested."""
    return bool(spec.scaling and spec.scaling.live)


async def new_scaleplan(rt: Runtime, body: dict[str, Any], spec: ModelServiceSpec, action: CreatePlan,
                        pods: dict[str, PodView], nodes: list[dict[str, Any]],
                        manifests: Manifests | None = None) -> dict[str, Any]:
    """The ScalePlan for `action`: planned on live node labels, over the real blocks of a source engine
    when there is one (raises ValueError when the plan cannot be built). `manifests`: filled with the source
    manifests read (source_manifest), for `start`."""
    meta = body["metadata"]
    algorithm = spec.scaling.multicast if spec.scaling else "chain"
    holders = action.sources or (action.targets if action.host_copy else ())  # a host copy has the real blocks
    manifest = await source_manifest(rt, [pods[s] for s in holders if s in pods], manifests) if holders else None
    model = SP.layout(spec.model.name, spec.model.layers, manifest=manifest)
    live = plans_live(spec)
    built = SP.build(action, pods, nodes, model, algorithm, spec.engine.tp, rt.settings.label_keys,
                     rt.settings.inter_leaf_ratio, live=live, topo=rt.topology(nodes),
                     copy_nodes=SP.node_copy_nodes(pods.values(), spec.model.name, rt.settings.node_cache)
                     - {n for (n, m), t in rt.node_copy_refused.items()
                        if m == spec.model.name and time.monotonic() - t < NODE_COPY_RETRY_S})
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ScalePlan",
            "metadata": {"generateName": f"{meta['name']}-{action.role}-", "namespace": meta["namespace"],
                         "labels": {L.MODEL_SERVICE: meta["name"], L.ROLE: action.role},
                         "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelService",
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": SP.spec_dict(built, meta["name"], action.role, action.reason, checkpoint_path(spec),
                                  spec.model.dtype)}


async def start(rt: Runtime, sp: dict[str, Any], decided_at: float, manifests: Manifests | None = None) -> None:
    """The fast path: instruct the plan this process just created (`sp`: the API server's answer) at once.
    `manifests`: the source manifests its build read a moment ago (new_scaleplan), not fetched again."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    async with rt.lock(ns, name):
        drops = await instruct_pending(rt, sp, created=True, manifests=manifests)
    rt.metrics.instruct.observe(time.perf_counter() - decided_at)
    for iid, why in drops.items():  # nothing was labelled for these; the driver sees them in the status
        await _drop(rt, sp, None, f"{iid}: {why}", unreachable=False)


async def drive(rt: Runtime, sp: dict[str, Any], stopped: Any) -> None:
    """Follow one plan to its end. Every target loss drops the target and unbinds it: its pod deleted,
    its engine unreachable for UNREACHABLE_LIMIT_S or reporting a load error, its bind refused. The
    others go on; the plan fails only when no target is left, and the reconciler plans replacements."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    pool_ns, _, key = plan_pool(rt, sp)
    throttle = SP.Throttle(rt.settings.status_write_interval_seconds)
    started, unreachable_since = time.monotonic(), dict[str, float]()
    seen: dict[str, tuple[bool, str | None]] = {}  # per target: bound in the pod index, engine phase (logged on change)
    unlabelled_since: dict[str, float] = {}
    # drops survive a restart: they are in the status
    dropped = {t["instance"]: t["failed"] for t in (sp.get("status") or {}).get("targets") or [] if t.get("failed")}
    while not stopped:
        # the plan and its pods come from the watch-fed indexes: hundreds of plans in flight must not
        # each GET and LIST on the API server five times a second
        cur = next((p for p in await rt.scaleplans(ns) if p["metadata"]["name"] == name), None)
        if cur is None:  # not (or no longer) in the index: ask the API server once
            try:
                cur = await rt.kube.get_scaleplan(ns, name)
            except NotFound:
                return
        sp = cur
        if (sp.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return
        spec = sp["spec"]
        for t in (sp.get("status") or {}).get("targets") or []:  # e.g. dropped by the fast path (start)
            if t.get("failed"):
                dropped.setdefault(t["instance"], t["failed"])
        by_inst = {p.instance: p for p in (pod_view(x) for x in await rt.pool_pods(pool_ns)
                                           if not (x.get("metadata") or {}).get("deletionTimestamp"))}
        async with rt.lock(ns, name):
            newly = await instruct_pending(rt, sp, set(dropped))
        done = rt.instructed.get((ns, name), set())
        lost = dict(newly)
        for t in spec["targets"]:
            iid = t["instance"]
            if iid not in by_inst and iid not in dropped and iid not in lost and iid in done:
                lost[iid] = f"pod {t.get('pod') or iid} was deleted"
        statuses = await _statuses(rt, [t["instance"] for t in spec["targets"]], by_inst, dropped.keys() | lost.keys(),
                                   key, unreachable_since)
        for iid in statuses:
            why = await _check_label(rt, sp, by_inst.get(iid), iid in done and iid not in dropped and iid not in lost,
                                     unlabelled_since, iid)
            if why:
                lost[iid] = why
        view = {iid: (by_inst.get(iid) is not None and by_inst[iid].model_service == key, (st or {}).get("phase"))
                for iid, st in statuses.items()}
        if view != seen:
            seen = view
            log.info("ScalePlan %s/%s: targets (bound in index, engine phase): %s", ns, name,
                     ", ".join(f"{i}={b}/{ph}" for i, (b, ph) in sorted(view.items())))
        for iid, t0 in unreachable_since.items():
            if time.monotonic() - t0 > UNREACHABLE_LIMIT_S and iid not in dropped:
                lost.setdefault(iid, f"engine unreachable for {UNREACHABLE_LIMIT_S:.0f} s")
        for iid, st in statuses.items():
            if st and st.get("loadError") and iid not in dropped:
                lost.setdefault(iid, f"load error: {st['loadError']}")
            elif st and st.get("modelService") not in (None, key) and iid not in dropped:
                lost.setdefault(iid, f"engine is bound to {st.get('modelService')}")
        for iid in sorted(lost.keys() - dropped.keys()):
            dropped[iid] = lost[iid]
            await _drop(rt, sp, by_inst.get(iid), lost[iid], unreachable=iid in unreachable_since)
        await livewiring.advance(rt, pool_ns, spec, statuses, by_inst, dropped)  # λScale pipelines as blocks land
        st = SP.progress(spec, statuses, done, dropped, started, time.monotonic())
        st["observedGeneration"] = sp["metadata"].get("generation")
        st["conditions"] = keep_transition_times(plan_conditions(st["phase"], st.get("message", ""),
                                                                 st["observedGeneration"]),
                                                 (sp.get("status") or {}).get("conditions") or [])
        if st["phase"] in ("Succeeded", "Failed"):
            await _finish(rt, sp, st["phase"], dropped, started, st, by_inst)
            return
        if throttle.should_write(st["phase"]) or lost:
            await rt.kube.patch_scaleplan_status(ns, name, st)
        await asyncio.sleep(POLL_S)


async def _statuses(rt: Runtime, ids: list[str], by_inst: dict[str, PodView], skip: set[str], key: str,
                    unreachable_since: dict[str, float]) -> dict[str, dict[str, Any] | None]:
    """Each target's engine status (None: skipped, not bound to this service, or unreachable, which starts or
    keeps its `unreachable_since` clock; an answer clears it), every target at once: a round costs one status
    round trip, not one per target. These statuses are what `livewiring.advance` forms pipelines from, so a
    sequential round delayed every formation by the other targets' round trips (a loaded link's queue: up to
    0.3 s each in bench/live.py's netlab, ADR 0008)."""

    async def one(iid: str) -> dict[str, Any] | None:
        p = by_inst.get(iid)
        if iid in skip or p is None or p.model_service != key or not p.endpoint:
            return None
        try:
            st = await rt.engines.status(p.endpoint)
        except EngineError:
            unreachable_since.setdefault(iid, time.monotonic())
            return None
        unreachable_since.pop(iid, None)
        return st

    return dict(zip(ids, await asyncio.gather(*(one(i) for i in ids)), strict=True))


async def _check_label(rt: Runtime, sp: dict[str, Any], p: PodView | None, instructed: bool,
                       since: dict[str, float], iid: str) -> str | None:
    """An instructed target whose pod the watch has not shown bound for LABEL_LIMIT_S: the watch lags,
    or the label write was lost. Re-read the pod; label it again, or return why the target is lost
    (the plan never waits forever on a label)."""
    pool_ns, _, key = plan_pool(rt, sp)
    if not instructed or p is None or p.model_service == key:
        since.pop(iid, None)
        return None
    if time.monotonic() - since.setdefault(iid, time.monotonic()) < LABEL_LIMIT_S:
        return None
    since.pop(iid, None)
    try:
        fresh = pod_view(await rt.kube.get_pod(pool_ns, p.pod_name))
    except NotFound:
        return f"pod {p.pod_name} was deleted"
    if fresh.model_service == key:
        return None  # only the watch lags
    log.warning("ScalePlan %s/%s: pod %s not labelled bound %.0f s after its engine accepted; labelling again",
                sp["metadata"]["namespace"], sp["metadata"]["name"], p.pod_name, LABEL_LIMIT_S)
    if await label_bound(rt, sp, fresh, sp["spec"]["role"]):
        return None
    return f"pod {p.pod_name} could not be labelled bound"


async def _drop(rt: Runtime, sp: dict[str, Any], p: PodView | None, reason: str, unreachable: bool) -> None:
    """Take a lost target out of its plan: the others go on (their chains re-fetch from a fallback
    source). Its engine is released when reachable; its pod, if this plan labelled it, leaves the
    service (marked unhealthy when its engine is gone, so it is never chosen again); the reconciler
    plans a replacement."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    pool_ns, svc, key = plan_pool(rt, sp)
    log.warning("ScalePlan %s/%s: dropping target %s (%s)", ns, name, p.pod_name if p else "?", reason)
    if p is not None:
        if not unreachable and p.endpoint:
            try:
                st = await rt.engines.status(p.endpoint)
                if st.get("modelService") == key:
                    await rt.engines.release(p.endpoint)  # reachable but failed: it can go back to the pool
            except EngineError as e:
                log.warning("%s", e)
        if p.model_service == key and p.plan == name:
            await _unbind_own(rt, pool_ns, p, key, name, reason if unreachable else None)
    owner = {"metadata": {"name": svc,
                          "uid": next((o["uid"] for o in sp["metadata"].get("ownerReferences") or []), None)}}
    await rt.event(
        ns,
        owner,
        "ModelService",
        "Warning",
        "TargetDropped",
        f"ScalePlan {name}: target {p.pod_name if p else '?'} dropped ({reason}); a new plan will replace it",
    )


async def _unbind_own(rt: Runtime, pool_ns: str, p: PodView, key: str, plan: str, unhealthy: str | None) -> None:
    """Unbind a pod this plan bound, retrying conflicts while the pod is still this plan's (a lost unbind
    left the pod bound to the service forever, and nothing replanned)."""
    await patch_guarded(rt, pool_ns, p, lambda cur: unbind_patch(cur, unhealthy)
                         if cur.model_service == key and cur.plan == plan else None)


async def _finish(rt: Runtime, sp: dict[str, Any], phase: str, failed: dict[str, str], started: float,
                  st: dict[str, Any], pods: dict[str, PodView]) -> None:
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    pool_ns, svc, key = plan_pool(rt, sp)
    status = dict(st)
    status["completionTime"] = now_iso()
    if phase == "Succeeded":
        for p in pods.values():
            if p.plan == name and p.model_service == key:
                try:
                    await rt.kube.patch_pod(pool_ns, p.pod_name, {"metadata": {"annotations": {L.LOADED: "true",
                                                                                               L.LIVE: None}}})
                except (Conflict, NotFound) as e:
                    log.warning("marking %s loaded: %s", p.pod_name, e)
    if phase == "Failed":
        # fail cleanly: targets this plan bound and that are not serving go back to the pool
        for p in pods.values():
            if p.plan == name and p.model_service == key and not p.ready and p.instance not in failed:
                await _drop(rt, sp, p, "its ScalePlan failed", unreachable=False)
        # and the claims its creating round took on them end with it: kept for RESERVE_S they kept a target
        # released back to the pool (or healed, recovery.py) from the service's next plan for up to 30 s
        rt.unreserve(pool_ns, [t.get("pod") or t["instance"] for t in sp["spec"].get("targets") or []])
    # the outcome is recorded (duration metric, Event) before the terminal status write, which must come
    # last: the daemon driving this plan runs only while the phase is not terminal, so kopf cancels it as
    # soon as the watch shows this write, often before the write's own response is read. Recorded after
    # it, 1 plan in ~5 lost its metric and its Event (the dashboard's duration panel stayed NaN).
    rt.metrics.plan_duration.labels(ns, svc, phase).observe(time.monotonic() - started)
    owner = {"metadata": {"name": svc,
                          "uid": next((o["uid"] for o in sp["metadata"].get("ownerReferences") or []), None)}}
    await rt.event(ns, owner, "ModelService", "Normal" if phase == "Succeeded" else "Warning",
                   f"ScalePlan{phase}", f"ScalePlan {name}: {status.get('targetsReady', '')} "
                   f"{status.get('message', '')}".strip())
    await rt.kube.patch_scaleplan_status(ns, name, status)


async def release_all(rt: Runtime, body: dict[str, Any]) -> list[str]:
    """On ModelService deletion: drain, release and unbind every bound pool pod (it goes back to the
    pool, without the service's ownerReference); delete the fallback pods created for the service and
    its ScalePlans (the garbage collector would too, through their ownerReferences, but only within one
    namespace and only where kube-controller-manager runs). Each step is tried whatever the others did;
    returns what could not be done, one line each (the pod and why), for the caller to report."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    pool_ns = rt.pool_namespace(ns)
    key = service_key(ns, name, pool_ns)
    problems: list[str] = []
    for raw in await rt.kube.list_pods(pool_ns, L.POOL):
        p = pod_view(raw)
        if p.model_service == key:
            if p.endpoint:
                for verb, call in (("drained", rt.engines.drain),
                                   ("released", lambda ep: rt.engines.release(ep, keep_host_copy=False))):
                    try:  # the service is gone: its engines keep no host copy
                        await call(p.endpoint)
                    except EngineError as e:
                        log.warning("%s", e)
                        problems.append(f"pod {pool_ns}/{p.pod_name}: engine not {verb} ({e})")
            if p.created_for != key:
                try:
                    await rt.kube.patch_pod(pool_ns, p.pod_name, unbind_patch(p))
                except Conflict as e:
                    log.warning("unbinding %s: %s", p.pod_name, e)
                    problems.append(f"pod {pool_ns}/{p.pod_name}: not unbound ({e})")
                except NotFound:
                    pass  # gone: nothing left bound
        if p.created_for == key:
            with contextlib.suppress(NotFound):
                await rt.kube.delete_pod(pool_ns, p.pod_name)
    for sp in await rt.kube.list_scaleplans(ns):
        if (sp.get("spec") or {}).get("modelServiceRef", {}).get("name") == name:
            with contextlib.suppress(NotFound):
                await rt.kube.delete_scaleplan(ns, sp["metadata"]["name"])
    return problems
