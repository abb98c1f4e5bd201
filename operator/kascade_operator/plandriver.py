"""Drives one ScalePlan from creation to Succeeded/Failed: bind targets, instruct every participant
exactly once, track progress, mark loaded pods, finish the ModelService's scale-up.

Data flow: `new_scaleplan` (CreatePlan -> planner -> ScalePlan body with an ownerReference to the
ModelService) -> `start` (fast path, right after creation) and `drive` (kopf daemon; also what runs
after an operator restart) -> `instruct_pending` under a per-plan lock -> engine control API;
progress -> throttled ScalePlan status. Exactly once across restarts: a target counts as instructed
when the status says so, or when its engine already reports being bound to this service and loading
or ready (the operator may have died between the engine call and the status write).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kascade_operator import labels as L
from kascade_operator import scaleplan as SP
from kascade_operator.api import ModelServiceSpec
from kascade_operator.engine_client import EngineError
from kascade_operator.kube import GROUP, VERSION, Conflict, NotFound, now_iso
from kascade_operator.pool import PodView, bind_patch, pod_view, unbind_patch
from kascade_operator.reconcile import CreatePlan
from kascade_operator.runtime import Runtime

log = logging.getLogger(__name__)

POLL_S = 0.2
UNREACHABLE_LIMIT_S = 5.0  # an instructed target whose engine stays unreachable this long fails the plan


async def source_manifest(rt: Runtime, sources: list[PodView]) -> dict[str, Any] | None:
    """The block manifest of the first source engine that offers one (real block ids and sizes)."""
    for p in sources:
        if p.endpoint:
            try:
                m = await rt.engines.manifest(p.endpoint)
            except EngineError as e:
                log.warning("manifest of %s: %s", p.pod_name, e)
                continue
            if m:
                return m
    return None


async def new_scaleplan(rt: Runtime, body: dict[str, Any], spec: ModelServiceSpec, action: CreatePlan,
                        pods: dict[str, PodView], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The ScalePlan for `action`: planned on live node labels, over the real blocks of a source engine
    when there is one (raises ValueError when the plan cannot be built)."""
    meta = body["metadata"]
    algorithm = spec.scaling.multicast if spec.scaling else "chain"
    manifest = await source_manifest(rt, [pods[s] for s in action.sources if s in pods]) if action.sources else None
    model = SP.layout(spec.model.name, spec.model.layers, manifest=manifest)
    built = SP.build(action, pods, nodes, model, algorithm, spec.engine.tp, rt.settings.label_keys,
                     rt.settings.inter_leaf_ratio, live=spec.scaling.live if spec.scaling else False)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ScalePlan",
            "metadata": {"generateName": f"{meta['name']}-{action.role}-", "namespace": meta["namespace"],
                         "labels": {L.MODEL_SERVICE: meta["name"], L.ROLE: action.role},
                         "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelService",
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": SP.spec_dict(built, meta["name"], action.role, action.reason, spec.model.source.path)}


def fallback_pod(spec: ModelServiceSpec, service: str, role: str, token_secret: str = "kascade-engine-token",
                 act_port: int = 18516) -> dict[str, Any]:
    """The slow path: a new warm-pool engine pod, started like the chart's pool pods for this model
    (config and tokenizer from the source directory, mounted from the node); it joins the pool and is
    bound in a later round like any pool pod. Only `path` sources can be mounted this way."""
    e, src = spec.engine, spec.model.source
    if not src.path:
        raise ValueError("spec.model.source: a new engine pod can only mount a `path` source (pvc/uri: use the pool)")
    container: dict[str, Any] = {
        "name": "engine", "image": e.image,
        "args": ["kascade", "engine", "serve", "--empty", "--host=0.0.0.0", f"--port={e.port}", f"--act-port={act_port}",
                 f"--checkpoint={src.path}", f"--model-name={spec.model.name}"],
        "env": [{"name": "KASCADE_ENGINE_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}}],
        "ports": [{"containerPort": e.port, "name": "http"}, {"containerPort": e.data_port, "name": "data"},
                  {"containerPort": act_port, "name": "act"}],
        "volumeMounts": [{"name": "model", "mountPath": src.path, "readOnly": True}]}
    if e.resources:
        container["resources"] = e.resources.model_dump(exclude_none=True)
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"generateName": f"kascade-pool-{service}-",
                                        "labels": {L.POOL: L.POOL_WARM, L.MANAGED_BY: "kascade"}},
                           "spec": {"containers": [container], "automountServiceAccountToken": False,
                                    "volumes": [{"name": "model", "hostPath": {"path": src.path, "type": "Directory"}}]}}
    if e.node_selector:
        pod["spec"]["nodeSelector"] = dict(e.node_selector)
    if e.tolerations:
        pod["spec"]["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in e.tolerations]
    return pod


async def _bind_targets(rt: Runtime, sp: dict[str, Any], pods: dict[str, PodView], ids: list[str]) -> dict[str, str]:
    """Bind each target pod to the service (guarded). Returns failures: instance -> reason."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    svc, role = sp["spec"]["modelServiceRef"]["name"], sp["spec"]["role"]
    failed: dict[str, str] = {}
    pod_of = {t["instance"]: t["pod"] for t in sp["spec"]["targets"]}
    for iid in ids:
        p = pods.get(pod_of[iid])
        for _ in range(2):
            if p is None:
                failed[iid] = f"pod {pod_of[iid]} is gone"
                break
            if p.model_service == svc and p.plan == name:
                break  # bound by this plan already (e.g. before a restart)
            if p.model_service is not None:
                failed[iid] = f"pod {p.pod_name} is bound to {p.model_service}"
                break
            try:
                await rt.kube.patch_pod(ns, p.pod_name, bind_patch(p, svc, role, name))
                break
            except Conflict:
                fresh = await rt.kube.list_pods(ns, L.POOL)
                p = next((pod_view(x) for x in fresh if x["metadata"]["name"] == pod_of[iid]), None)
            except NotFound:
                p = None
        else:
            failed[iid] = f"pod {pod_of[iid]} kept changing while binding"
    return failed


async def instruct_pending(rt: Runtime, sp: dict[str, Any], skip: set[str] | frozenset[str] = frozenset()
                           ) -> dict[str, str]:
    """Instruct every not-yet-instructed target (and, for transfer plans, the sources) exactly once;
    `skip`: targets dropped from the plan (never bound again by it)."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    spec, status = sp["spec"], sp.get("status") or {}
    done = rt.instructed.setdefault((ns, name), set())
    pending = [i for i in SP.to_instruct(spec, status) if i not in done and i not in skip]
    if not pending:
        return {}
    pods = {p.pod_name: p for p in (pod_view(x) for x in await rt.kube.list_pods(ns, L.POOL))}
    failed = await _bind_targets(rt, sp, pods, pending)
    svc, role, plan = spec["modelServiceRef"]["name"], spec["role"], spec.get("plan") or {}
    model = (plan.get("model") or {}).get("name", "")
    by_inst = {p.instance: p for p in pods.values()}
    peers = {i: ep for i, p in by_inst.items() if (ep := p.data_endpoint)}
    token = rt.engines.plan_secret(ns, name, str(sp["metadata"].get("uid", "")))  # never derivable from the CR
    local = spec["algorithm"] == "local"
    manifest = None
    if not local:
        for s in spec["sources"]:
            src = by_inst.get(s["instance"])
            if src and src.endpoint and s["instance"] not in done:
                try:
                    manifest = manifest or await rt.engines.manifest(src.endpoint)
                    await rt.engines.load_plan(src.endpoint, plan, s["instance"], peers, token)
                except EngineError as e:
                    if e.status != 409:  # 409: this source already runs the plan
                        failed[s["instance"]] = str(e)
                done.add(s["instance"])

    host_path = {src.get("node"): src.get("path") for src in spec["sources"] if src.get("kind") == "host"}
    live_with = {t: s for s, t in plan.get("livePairs") or []}

    async def one(iid: str) -> None:
        p = by_inst.get(iid)
        if p is None or not p.endpoint:
            failed[iid] = f"target {iid} has no engine endpoint (annotation {L.ENDPOINT})"
            return
        path = host_path.get(p.node) if local else None
        if local and not path:
            failed[iid] = ("the first copy loads only from spec.model.source.path (a directory every engine pod "
                           "mounts); pvc and uri sources are not loadable by the engine yet")
            return
        try:
            st = await rt.engines.status(p.endpoint)
            if st.get("modelService") == svc and st.get("phase") in ("loading", "live", "serving", "ready"):
                return  # already instructed by an earlier incarnation of the operator
            await rt.engines.bind(p.endpoint, model, svc, role, path)
            if not local:
                await rt.engines.load_plan(p.endpoint, plan, iid, peers, token, manifest)
        except EngineError as e:
            if e.status is None:  # timed out or unreachable: retried next round; the driver drops the
                retry.add(iid)    # target if its engine stays unreachable (UNREACHABLE_LIMIT_S)
                log.warning("%s (will retry)", e)
            else:
                failed[iid] = str(e)
            return
        pair = by_inst.get(live_with.get(iid, ""))
        if pair is not None and pair.act_endpoint:
            await _go_live(rt, ns, p, pair)

    retry: set[str] = set()
    await asyncio.gather(*(one(i) for i in pending if i not in failed))
    done.update(i for i in pending if i not in failed and i not in retry)
    rows = [{"instance": t["instance"], "instructed": t["instance"] in done} for t in spec["targets"]]
    await rt.kube.patch_scaleplan_status(ns, name, {"phase": "Failed" if failed else "Transferring",
                                                    "startTime": status.get("startTime") or now_iso(),
                                                    "targets": rows, **({"message": "; ".join(
                                                        f"{k}: {v}" for k, v in failed.items())[:2000]} if failed else {})})
    return failed


async def _go_live(rt: Runtime, ns: str, target: PodView, pair: PodView) -> None:
    """Live execution while loading: the target runs the layers it holds and ships activations to its
    overloaded pair, which finishes them (ZigZag); the annotation tells routers to send it requests.
    Best effort: if either step fails the target still loads, it just serves later."""
    assert pair.act_endpoint is not None and target.endpoint is not None
    try:
        await rt.engines.cooperate(target.endpoint, pair.act_endpoint, "zigzag")
        await rt.kube.patch_pod(ns, target.pod_name, {"metadata": {"annotations": {L.LIVE: "true"}}})
    except (EngineError, Conflict, NotFound) as e:
        log.warning("live pairing %s with %s: %s", target.pod_name, pair.pod_name, e)


async def start(rt: Runtime, sp: dict[str, Any], decided_at: float) -> None:
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    async with rt.lock(ns, name):
        await instruct_pending(rt, sp)
    rt.metrics.instruct.observe(time.perf_counter() - decided_at)


async def drive(rt: Runtime, sp: dict[str, Any], stopped: Any) -> None:
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    throttle = SP.Throttle(rt.settings.status_write_interval_seconds)
    started, unreachable_since, dropped = time.monotonic(), dict[str, float](), dict[str, str]()
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
        async with rt.lock(ns, name):
            failed = await instruct_pending(rt, sp, set(dropped))
        if failed:
            await _finish(rt, sp, "Failed", failed, started)
            return
        spec = sp["spec"]
        svc = spec["modelServiceRef"]["name"]
        pods = {p.instance: p for p in (pod_view(x) for x in await rt.pool_pods(ns))
                if p.model_service == svc}
        statuses: dict[str, dict[str, Any] | None] = {}
        for t in spec["targets"]:
            p = pods.get(t["instance"])
            try:
                statuses[t["instance"]] = await rt.engines.status(p.endpoint) if p and p.endpoint else None
                unreachable_since.pop(t["instance"], None)
            except EngineError:
                statuses[t["instance"]] = None
                unreachable_since.setdefault(t["instance"], time.monotonic())
        dead = {i: f"engine unreachable for {UNREACHABLE_LIMIT_S:.0f} s" for i, t0 in unreachable_since.items()
                if time.monotonic() - t0 > UNREACHABLE_LIMIT_S}
        dead.update({i: f"load error: {s['loadError']}" for i, s in statuses.items() if s and s.get("loadError")})
        for iid in sorted(dead.keys() - dropped.keys()):
            dropped[iid] = dead[iid]
            await _drop(rt, sp, pods.get(iid), dead[iid], unreachable=iid in unreachable_since)
        done = rt.instructed.get((ns, name), set())
        st = SP.progress(spec, statuses, done, dropped, started, time.monotonic())
        if st["phase"] in ("Succeeded", "Failed"):
            await _finish(rt, sp, st["phase"], dropped, started, st, pods)
            return
        if throttle.should_write(st["phase"]):
            await rt.kube.patch_scaleplan_status(ns, name, st)
        await asyncio.sleep(POLL_S)


async def _drop(rt: Runtime, sp: dict[str, Any], p: PodView | None, reason: str, unreachable: bool) -> None:
    """Take a dead or failed target out of its plan: the others go on (their chains re-fetch from a
    fallback source); its pod leaves the service, marked unhealthy if its engine is gone, so the
    reconciler plans a replacement on another pod."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    if p is None:
        return
    log.warning("ScalePlan %s/%s: dropping target %s (%s)", ns, name, p.pod_name, reason)
    if not unreachable and p.endpoint:
        try:
            await rt.engines.release(p.endpoint)  # reachable but failed: it can go back to the pool
        except EngineError as e:
            log.warning("%s", e)
    try:
        await rt.kube.patch_pod(ns, p.pod_name, unbind_patch(p, reason if unreachable else None))
    except (Conflict, NotFound) as e:
        log.warning("unbinding %s: %s", p.pod_name, e)
    owner = {"metadata": {"name": sp["spec"]["modelServiceRef"]["name"],
                          "uid": next((o["uid"] for o in sp["metadata"].get("ownerReferences") or []), None)}}
    await rt.kube.event(ns, owner, "ModelService", "Warning", "TargetDropped",
                        f"ScalePlan {name}: target {p.pod_name} dropped ({reason}); a new plan will replace it")


async def _finish(rt: Runtime, sp: dict[str, Any], phase: str, failed: dict[str, str], started: float,
                  st: dict[str, Any] | None = None, pods: dict[str, PodView] | None = None) -> None:
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    status = dict(st or {"phase": phase, "message": "; ".join(f"{k}: {v}" for k, v in failed.items())[:2000]})
    status["completionTime"] = now_iso()
    if phase == "Succeeded":
        for p in (pods or {}).values():
            if p.plan == name:
                try:
                    await rt.kube.patch_pod(ns, p.pod_name, {"metadata": {"annotations": {L.LOADED: "true",
                                                                                          L.LIVE: None}}})
                except (Conflict, NotFound) as e:
                    log.warning("marking %s loaded: %s", p.pod_name, e)
    if phase == "Failed":
        # fail cleanly: targets this plan bound and that are not serving go back to the pool
        if pods is None:
            svc = sp["spec"]["modelServiceRef"]["name"]
            pods = {p.instance: p for p in (pod_view(x) for x in await rt.kube.list_pods(ns, f"{L.MODEL_SERVICE}={svc}"))}
        for p in pods.values():
            if p.plan == name and not p.ready and p.instance not in failed:
                await _drop(rt, sp, p, "its ScalePlan failed", unreachable=False)
    await rt.kube.patch_scaleplan_status(ns, name, status)
    rt.metrics.plan_duration.labels(phase).observe(time.monotonic() - started)
    owner = {"metadata": {"name": sp["spec"]["modelServiceRef"]["name"],
                          "uid": next((o["uid"] for o in sp["metadata"].get("ownerReferences") or []), None)}}
    await rt.kube.event(ns, owner, "ModelService", "Normal" if phase == "Succeeded" else "Warning",
                        f"ScalePlan{phase}", f"ScalePlan {name}: {status.get('targetsReady', '')} "
                        f"{status.get('message', '')}".strip())


async def release_all(rt: Runtime, body: dict[str, Any]) -> None:
    """On ModelService deletion: drain, release and unbind every bound pod (best effort per pod)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for raw in await rt.kube.list_pods(ns, f"{L.MODEL_SERVICE}={name}"):
        p = pod_view(raw)
        if p.endpoint:
            for call in (rt.engines.drain, rt.engines.release):
                try:
                    await call(p.endpoint)
                except EngineError as e:
                    log.warning("%s", e)
        try:
            await rt.kube.patch_pod(ns, p.pod_name, unbind_patch(p))
        except (Conflict, NotFound) as e:
            log.warning("unbinding %s: %s", p.pod_name, e)
