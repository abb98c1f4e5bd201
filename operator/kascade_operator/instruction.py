"""Instructing a ScalePlan's participants, each exactly once: bind every target's engine, label its pod
bound only after the engine accepted, and send the load plan to the sources and the targets.

Data flow: the plan as the API server holds it now (never an ended one, never a dropped target) + the pool's
pods -> engine control API (manifest and load-plan to the sources; beside them status and bind to each target,
then its load-plan once the sources have theirs; livewiring for a live pair or pipeline hop) -> pod labels
(resourceVersion-guarded patches) -> the plan's status `targets` (instructed / failed, a guarded write) -> the
targets to drop, with why. Exactly once across
restarts: a target counts as instructed when the status says so, or when its engine already reports being
bound to this service and loading or ready. plandriver.py calls `instruct_pending` every round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kascade_operator import labels as L
from kascade_operator import livewiring
from kascade_operator import scaleplan as SP
from kascade_operator.engine_client import EngineError
from kascade_operator.kube import Conflict, NotFound, now_iso
from kascade_operator.pool import PodView, bind_patch, host_copy_patch, pod_view, service_key
from kascade_operator.runtime import Runtime
from kascade_planner.engine_api import BUSY

BUSY_PHASES = frozenset(p.value for p in BUSY)  # an engine in one of these was bound and told to load already
SWITCHABLE = frozenset({"empty", "released"})  # an engine holding no weights may change model at its bind

log = logging.getLogger(__name__)

Manifests = dict[str, dict[str, Any] | None]  # source endpoint -> its block manifest (tp 1; None: it offers none)


def plan_tp(plan: dict[str, Any]) -> int:
    """The GPUs of the plan's targets (engines run a plan into TP-g targets as g rank planes; 1: none)."""
    return max((int(t.get("gpus", 1)) for t in plan.get("targets") or () if isinstance(t, dict)), default=1)


def plan_pool(rt: Runtime, sp: dict[str, Any]) -> tuple[str, str, str]:
    """(pool namespace, service name, service key) of a ScalePlan."""
    ns, svc = sp["metadata"]["namespace"], sp["spec"]["modelServiceRef"]["name"]
    pool_ns = rt.pool_namespace(ns)
    return pool_ns, svc, service_key(ns, svc, pool_ns)


def _owner(sp: dict[str, Any], pool_ns: str) -> dict[str, Any] | None:
    """The ModelService's controller reference for pods of this plan (same namespace only)."""
    if pool_ns != sp["metadata"]["namespace"]:
        return None
    return next((dict(o) for o in sp["metadata"].get("ownerReferences") or [] if o.get("kind") == "ModelService"),
                None)


GUARDED_TRIES = 8


async def patch_guarded(rt: Runtime, pool_ns: str, p: PodView,
                         patch_for: Callable[[PodView], dict[str, Any] | None]) -> PodView | None:
    """Write `patch_for(pod)` (a resourceVersion-guarded patch) and return the pod as written. Pod status
    writes (readiness) bump the version every few seconds, so a conflict is normal: re-read and ask
    `patch_for` again, up to GUARDED_TRIES times. `patch_for` returns None when no write is wanted (any
    more); the pod as last seen is returned then. None: the pod is gone."""
    cur = p
    for _ in range(GUARDED_TRIES):
        patch = patch_for(cur)
        if patch is None:
            return cur
        try:
            return pod_view(await rt.kube.patch_pod(pool_ns, cur.pod_name, patch))
        except Conflict:
            try:
                cur = pod_view(await rt.kube.get_pod(pool_ns, cur.pod_name))
            except NotFound:
                return None
        except NotFound:
            return None
    log.warning("pod %s: still conflicting after %d tries", p.pod_name, GUARDED_TRIES)
    return cur


async def label_bound(rt: Runtime, sp: dict[str, Any], p: PodView, role: str, host_copy: str | None = None) -> bool:
    """Record a binding the engine accepted: label the pod bound. False when the pod is gone or taken
    meanwhile (or the label could not be written)."""
    _, _, key = plan_pool(rt, sp)
    cur = await label_bound_view(rt, sp, p, role, host_copy)
    return cur is not None and cur.model_service == key and cur.plan == sp["metadata"]["name"]


async def label_bound_view(rt: Runtime, sp: dict[str, Any], p: PodView, role: str,
                           host_copy: str | None = None) -> PodView | None:
    """label_bound, returning the pod as last seen (None: gone)."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    pool_ns, svc, _ = plan_pool(rt, sp)

    def bind(cur: PodView) -> dict[str, Any] | None:
        if cur.model_service is not None:  # already ours, or taken by another service
            return None
        return bind_patch(cur, svc, role, name, _owner(sp, pool_ns), ns if pool_ns != ns else None, host_copy)

    return await patch_guarded(rt, pool_ns, p, bind)


async def instruct_pending(rt: Runtime, sp: dict[str, Any], skip: set[str] | frozenset[str] = frozenset(),
                           created: bool = False, manifests: Manifests | None = None) -> dict[str, str]:
    """Instruct every not-yet-instructed target (and, for transfer plans, the sources) exactly once;
    `skip`: targets dropped from the plan (never bound again by it). Returns the targets to drop now
    (instance -> why: pod gone, bind refused, ...). A pod is labelled bound only after its engine
    accepted the bind. `created`: `sp` is the body the API server returned when this process created it.
    `manifests`: source manifests read for this plan's build a moment ago (plandriver.source_manifest), used
    instead of asking those sources again; only for a plan into TP-1 targets (TP-g targets get the manifest
    with the part entries, `manifest?parts=g`, which the build does not read)."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    untouched = (ns, name) not in rt.instructed  # nothing in this process instructed it or wrote its status yet
    done = rt.instructed.setdefault((ns, name), set())
    if not [i for i in SP.to_instruct(sp["spec"], sp.get("status")) if i not in done and i not in skip]:
        return {}
    # what the caller holds may be old (the driver holds the watch's copy): instruct from the plan as it is now,
    # never a plan that has ended, never a target it dropped (issue 38 #2). The creation body of a plan nothing
    # has instructed yet is how it is now (only this process's drivers write a new plan's status, and they
    # instruct first): the fast path saves the GET (an API round trip on every scale-up).
    fresh = created and untouched
    current = sp if fresh else await _current(rt, ns, name)
    if current is None or _ended(current):
        return {}
    sp = current
    spec, status = sp["spec"], sp.get("status") or {}
    skip = set(skip) | _failed(status).keys()
    pending = [i for i in SP.to_instruct(spec, status) if i not in done and i not in skip]
    if not pending:
        return {}
    pool_ns, _, key = plan_pool(rt, sp)
    # the pool from the watch-fed index (not a LIST of every pool pod per plan: O(pool) on each scale-up);
    # a pod changed since is caught by the guarded label write (patch_guarded re-reads on a conflict)
    pods = {p.pod_name: p for p in (pod_view(x) for x in await rt.pool_pods(pool_ns)
                                    if not (x.get("metadata") or {}).get("deletionTimestamp"))}
    role, plan = spec["role"], spec.get("plan") or {}
    model = (plan.get("model") or {}).get("name", "")
    dtype = spec.get("dtype")
    by_inst = {p.instance: p for p in pods.values()}
    pod_of = {t["instance"]: t.get("pod") or t["instance"] for t in spec["targets"]}
    peers = {i: ep for i, p in by_inst.items() if (ep := p.data_endpoint)}
    token = rt.engines.plan_secret(ns, name, str(sp["metadata"].get("uid", "")))  # never derivable from the CR
    local = spec["algorithm"] == "local"
    drops: dict[str, str] = {}
    tp = plan_tp(plan)
    known = manifests if manifests is not None and tp == 1 else {}
    manifest: dict[str, Any] | None = None
    sources_told = asyncio.Event()

    async def sources() -> None:
        """Each source: the manifest (the first that offers one, for the targets' load plans), its load plan."""
        nonlocal manifest
        try:
            for s in () if local else spec["sources"]:
                src = by_inst.get(s["instance"])
                if src and src.endpoint and s["instance"] not in done:
                    try:
                        if not manifest:
                            manifest = known[src.endpoint] if src.endpoint in known else \
                                await rt.engines.manifest(src.endpoint, tp)
                        await rt.engines.load_plan(src.endpoint, plan, s["instance"], peers, token)
                    except EngineError as e:
                        # the engine answers the plan it runs again with 200 (idempotent), so a 409 is ANOTHER
                        # plan on that source: it will not send this one; its targets take their fallback
                        log.warning("ScalePlan %s/%s: source %s does not send: %s", ns, name, s["instance"], e)
                        if s.get("hostCopy") and e.status not in (None, 409):  # its copy is gone (not just busy)
                            await _forget_stale_copy(rt, pool_ns, src)
                    done.add(s["instance"])
        finally:
            sources_told.set()

    host_path = {src.get("node"): src.get("path") for src in spec["sources"] if src.get("kind") == "host"}
    host_copy_nodes = {src.get("node") for src in spec["sources"] if src.get("hostCopy")}
    node_copy = {t["instance"] for t in spec["targets"] if t.get("nodeCopy")}  # load from their node's copy
    retry: set[str] = set()
    other_model: set[str] = set()
    model_path = switch_path(rt, ns, spec["modelServiceRef"]["name"])

    async def engage(iid: str, p: PodView, path: str | None, from_copy: bool,
                     from_node: bool) -> tuple[dict[str, Any] | None, bool]:
        """Bind a target's engine: (its status, whether an earlier incarnation of the operator had bound it
        already). (None, False): dropped, `drops` says why."""
        def bind(switch: str | None = None) -> Awaitable[dict[str, Any]]:
            return rt.engines.bind(p.endpoint or "", model, key, role, path, dtype, host_copy=from_copy,
                                   model_path=switch, node_copy=from_node)

        if fresh and p.model == model and p.model_service is None:
            # a plan this process just made, into a free pod whose engine (its pod says) holds this model: bind at
            # once, no status read first (a round trip on every scale-up). A 409: the engine is not as its pod
            # says (another model, bound meanwhile, no copy): read its status and decide as below
            try:
                return await bind(), False
            except EngineError as e:
                if e.status != 409:
                    raise
        st = await rt.engines.status(p.endpoint or "")
        switch = None
        if st.get("model") and st["model"] != model:
            # a released engine of another model changes model (the shared pool, issue 35): it reads the
            # model's config and tokenizer from its checkpoint directory, the weights come by this plan
            switch = model_path if st.get("phase") in SWITCHABLE else None
            if switch is None:
                drops[iid] = f"pod {p.pod_name}'s engine holds model '{st['model']}', not '{model}'" + \
                    ("" if model_path else " (no spec.model.source.path to switch it by)")
                other_model.add(p.pod_name)
                return None, False
        if st.get("modelService") == key and st.get("phase") in BUSY_PHASES:
            return st, True  # instructed by an earlier incarnation of the operator
        return await bind(switch), False

    async def one(iid: str) -> None:
        p = pods.get(pod_of[iid])
        if p is None:
            drops[iid] = f"pod {pod_of[iid]} is gone"
            return
        if not p.endpoint:
            drops[iid] = f"target {iid} has no engine endpoint (annotation {L.ENDPOINT})"
            return
        if p.model_service not in (None, key):
            drops[iid] = f"pod {p.pod_name} is bound to {p.model_service}"
            return
        from_node = iid in node_copy
        from_copy = local and p.node in host_copy_nodes and not from_node
        path = host_path.get(p.node) if local and not from_copy and not from_node else None
        if local and not path and not from_copy and not from_node:
            drops[iid] = "the first copy loads from spec.model.source (path, pvc or file:// uri); this plan names none"
            return
        try:
            st, again = await engage(iid, p, path, from_copy, from_node)
            if st is None:
                return  # dropped: engage said why
        except EngineError as e:
            if from_node and e.status == 409:  # no usable copy there: the next plans stream to that node
                rt.node_copy_refused[(p.node or "", model)] = time.monotonic()
            if from_copy and e.status == 409:  # the engine no longer keeps it: never offered again
                with contextlib.suppress(Conflict, NotFound):
                    await rt.kube.patch_pod(pool_ns, p.pod_name, host_copy_patch(None))
            if e.status is None:  # timed out or unreachable: retried next round; the driver drops the
                retry.add(iid)    # target if its engine stays unreachable (UNREACHABLE_LIMIT_S)
                log.warning("%s (will retry)", e)
            else:
                drops[iid] = f"bind refused: {e}"
            return
        cur = await label_bound_view(rt, sp, p, role, model if st.get("hostCopyBytes") else None)  # copy kept
        if cur is None or cur.model_service != key or cur.plan != name:
            drops[iid] = f"pod {p.pod_name} changed or went away while binding"
            log.warning("ScalePlan %s/%s: %s", ns, name, drops[iid])
            if cur is not None and cur.model_service == key and cur.plan:
                # another plan of this service labelled it first (a duplicate plan made while the watch lagged):
                # the engine is that plan's now; releasing it left that plan waiting for an empty engine forever
                log.warning("ScalePlan %s/%s: %s is plan %s's; its engine is left bound", ns, name, p.pod_name,
                            cur.plan)
                return
            try:
                await rt.engines.release(p.endpoint)
            except EngineError as e:
                log.warning("%s", e)
            return
        log.info("ScalePlan %s/%s: target %s (pod %s) bound%s", ns, name, iid, p.pod_name,
                 " (already, by an earlier operator)" if again else "")
        if not local and not again and not from_node:
            # a target's status, bind and label do not depend on the sources and run beside their load plans (a
            # scale-up's bind came after the source's manifest and load-plan round trips); its own load plan
            # waits for them: it carries the manifest a source gave, and the sources keep getting their load
            # plans first, as before (each source then pushes at the plan's notBefore; a target not listening
            # yet is retried, docs/dataplane.md)
            await sources_told.wait()
            try:
                await rt.engines.load_plan(p.endpoint, plan, iid, peers, token, manifest)
            except EngineError as e:
                if e.status is None:
                    retry.add(iid)
                    log.warning("%s (will retry)", e)
                else:  # a 409 too: the engine answers the same plan asked again with 200 (idempotent), so a
                    # 409 is another plan's load running there or another model: this plan gets nothing from it
                    drops[iid] = f"load plan refused: {e}"
                return
        await livewiring.instructed(rt, pool_ns, spec, iid, p, by_inst)  # live pair or pipeline hop

    await asyncio.gather(sources(), *(one(i) for i in pending))
    if other_model:  # a pool whose pods do not say their model: learn them all now, not one failed plan each
        await _record_models(rt, pool_ns, [p for p in pods.values() if p.model is None and p.model_service is None])
    done.update(i for i in pending if i not in drops and i not in retry)
    await _write_instructed(rt, sp, done, drops)
    return drops


def switch_path(rt: Runtime, ns: str, service: str) -> str | None:
    """The directory an engine of another model reads the service's model config from to switch to it: the
    ModelService's spec.model.source.path (a hostPath on every node) or a file:// URI; None otherwise (a pvc
    is mounted by fallback pods only, a Hub model is downloaded at bind: such targets are dropped as before)."""
    body = next(iter((rt.service_index or {}).get((ns, service), ())), None)
    src = (((body or {}).get("spec") or {}).get("model") or {}).get("source") or {}
    if src.get("path"):
        return str(src["path"])
    uri = str(src.get("uri") or "")
    return uri.removeprefix("file://") if uri.startswith("file:///") else None


def _ended(sp: dict[str, Any]) -> bool:
    return (sp.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _failed(status: dict[str, Any]) -> dict[str, str]:
    """Targets the plan has dropped (instance -> why), as its status records them."""
    return {t["instance"]: t["failed"] for t in status.get("targets") or [] if t.get("failed")}


async def _current(rt: Runtime, ns: str, name: str) -> dict[str, Any] | None:
    """The plan as the API server holds it now (None: deleted)."""
    try:
        return await rt.kube.get_scaleplan(ns, name)
    except NotFound:
        return None


async def _write_instructed(rt: Runtime, sp: dict[str, Any], done: set[str], drops: dict[str, str]) -> None:
    """Record which targets are instructed and which were dropped. The write is guarded by the version it was
    built from: a conflict re-reads, and a plan that has ended meanwhile keeps its terminal status (an
    unguarded write built from an older read landed after the driver's Failed and left the plan Transferring,
    its daemon gone, its ModelService wedged: issue 38 defect 2)."""
    ns, name = sp["metadata"]["namespace"], sp["metadata"]["name"]
    for _ in range(GUARDED_TRIES):
        status = sp.get("status") or {}
        failed = _failed(status) | drops
        rows = [{"instance": t["instance"], "instructed": t["instance"] in done,
                 **({"failed": failed[t["instance"]][:500]} if t["instance"] in failed else {})}
                for t in sp["spec"]["targets"]]
        try:
            await rt.kube.patch_scaleplan_status(ns, name, {"phase": status.get("phase") or "Transferring",
                                                            "observedGeneration": sp["metadata"].get("generation"),
                                                            "startTime": status.get("startTime") or now_iso(),
                                                            "targets": rows},
                                                 resource_version=sp["metadata"].get("resourceVersion"))
            return
        except Conflict:
            fresh = await _current(rt, ns, name)
            if fresh is None or _ended(fresh):
                return
            sp = fresh
    log.warning("ScalePlan %s/%s: instructed targets not recorded, still conflicting after %d tries", ns, name,
                GUARDED_TRIES)


async def _record_models(rt: Runtime, pool_ns: str, pods: list[PodView]) -> None:
    """Annotate idle pool pods that do not say their model (kascade.io/model) with the model their engine
    holds (it binds no other): every later round picks only pods of its own model (pool.can_serve)."""

    async def one(p: PodView) -> None:
        try:
            held = (await rt.engines.status(p.endpoint or "")).get("model") if p.endpoint else None
        except EngineError:
            return
        if held:
            with contextlib.suppress(Conflict, NotFound):
                await rt.kube.patch_pod(pool_ns, p.pod_name, {"metadata": {"annotations": {L.MODEL: held}}})
            log.info("pod %s: its engine holds model %s (recorded as %s)", p.pod_name, held, L.MODEL)

    await asyncio.gather(*(one(p) for p in pods))


async def _forget_stale_copy(rt: Runtime, pool_ns: str, p: PodView) -> None:
    """A host-copy source refused its load plan: when its engine keeps no copy (restarted, or evicted),
    clear the pod's record so no later plan names it (its targets re-fetch from a fallback source)."""
    try:
        if (await rt.engines.status(p.endpoint or "")).get("hostCopyBytes"):
            return
    except EngineError:
        return
    with contextlib.suppress(Conflict, NotFound):
        await rt.kube.patch_pod(pool_ns, p.pod_name, host_copy_patch(None))
    log.warning("pod %s keeps no host copy any more: record cleared", p.pod_name)
