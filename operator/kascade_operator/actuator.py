"""The act step of a round, the only one that writes: `act(rt, world, decision)` carries a Decision
(decision.py) out through kube.py and the engine client, and records the round in the operator's memory.

Order: claim this round's plan targets (before the first await: observe read the other rounds' claims last) ->
remember the round's clocks -> convert decoders -> the reconcile actions (`apply`, one each) -> host copies ->
unhealthy pods healed or checked later (recovery.py) ->
serving gates and labels -> the status (only when it changed) -> ModelServiceRole statuses -> prune finished
plans -> operator metrics -> the service's ask on its pool's fleet board (fleetboard.py) and a round for each
donor preempted for it. A CreatePlan is built here from the decision with the real block manifest of its source
engine (plandriver.new_scaleplan: the one read in act, and only a scale-up makes it).

Data flow of one action: `reconcile.reconcile` -> actions (CreatePlan, CreatePods, Drain, Release) -> `apply` ->
a ScalePlan created and its targets instructed at once (plandriver.start), fallback pods created (refused by the pod
template policy with a Blocker), a pod's drain annotated and its serving gate closed, a drained pod's engine
released (keeping a host copy when the pool needs one) and the pod unbound.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from kascade_operator import converter, hostcopykeeper, plandriver, recovery, rounds, serving_gate, trace
from kascade_operator.api import ModelServiceSpec
from kascade_operator.engine_client import EngineError
from kascade_operator.instruction import Manifests
from kascade_operator.kube import Conflict, NotFound, now_iso
from kascade_operator.podtemplate import fallback_pod, refusals
from kascade_operator.pool import (
    PodView,
    drain_patch,
    keep_host_copy,
    owner_ref,
    pod_view,
    service_key,
    unbind_patch,
)
from kascade_operator.reconcile import TERMINAL, CreatePlan, CreatePods, Drain, Release
from kascade_operator.runtime import Runtime
from kascade_operator.status import Blocker
from kascade_operator.world import Decision, World

log = logging.getLogger(__name__)

DECISION_LOG_S = 60.0  # a decision repeated unchanged round after round is logged at INFO this often


async def apply(rt: Runtime, body: dict[str, Any], spec: ModelServiceSpec, pods: list[PodView], action: Any,
                decided_at: float) -> Blocker | None:
    """Carry out one action; returns a Blocker when the operator refuses to (it then says why in Stalled)."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    pool_ns = rt.pool_namespace(ns)
    by_name = {p.pod_name: p for p in pods}
    if isinstance(action, CreatePlan):
        t0 = time.perf_counter()
        manifests: Manifests = {}  # the sources' manifests the build reads; the instruct reuses them
        try:
            sp = await plandriver.new_scaleplan(rt, body, spec, action, by_name, await rt.nodes(), manifests)
        except ValueError as e:
            rt.unreserve(pool_ns, (*action.targets, *action.sources))
            await rt.event(ns, body, "ModelService", "Warning", "PlanFailed", str(e))
            return None
        rt.metrics.plan_generation.observe(time.perf_counter() - t0)
        trace.event("planned", (ns, name))
        created = await rt.kube.create_scaleplan(ns, sp)
        # the next round sees it even while the watch lags (Runtime.scaleplans: until the watch shows it, or
        # 60 s): the round does not wait for the watch. It used to poll it for up to 2 s here, holding the
        # service's key: the service's next change round started that much late (issue 33)
        rt.created_plan(ns, created)
        trace.event("plan", (ns, name), created["metadata"]["name"])
        # the fast path: instruct now instead of waiting for the ScalePlan daemon to start; the Event comes
        # after (an API round trip off every reaction)
        await plandriver.start(rt, created, decided_at, manifests)
        # the claims count from now: an instruct that took longer than RESERVE_S under load (seen: 50 s) left
        # its targets unclaimed while the watch had not shown them bound yet, and a round chose them again
        rt.reserve(pool_ns, (*action.targets, *action.sources))
        trace.event("instructed", (ns, name))
        await rt.event(ns, body, "ModelService", "Normal", "ScaleUp",
                       f"{action.role}: ScalePlan {created['metadata']['name']} binds "
                       f"{', '.join(action.targets)} ({action.reason})")
    elif isinstance(action, CreatePods):
        refused = refusals(spec, rt.settings)
        if refused:
            msg = f"{action.role}: warm pool short by {action.count}; not creating pods: " + "; ".join(refused)
            await rt.event(ns, body, "ModelService", "Warning", "Forbidden", msg)
            return Blocker("Forbidden", msg)
        key = service_key(ns, name, pool_ns)
        owner = owner_ref(meta) if pool_ns == ns else None
        pod = fallback_pod(spec, key, rt.settings.engine_token_secret, owner,
                           hf_endpoint=rt.settings.hf_endpoint, hf_token_secret=rt.settings.hf_token_secret,
                           log_format=rt.settings.engine_log_format, tls_secret=rt.settings.engine_tls_secret,
                           run_as_user=rt.settings.engine_run_as_user, transport=rt.settings.engine_transport,
                           ucx_tcp_ports=rt.settings.engine_ucx_tcp_ports,
                           activation_dscp=rt.settings.engine_activation_dscp,
                           host_cache_gib=rt.settings.engine_host_cache_gib,
                           installation_capacity=rt.settings.engine_capacity, dtype=rt.settings.engine_dtype,
                           default_resources=rt.settings.engine_resources, gpu_resource=rt.settings.gpu_resource,
                           require_prefill_signature=rt.settings.engine_require_prefill_signature,
                           extra_args=rt.settings.engine_extra_args)
        made = []
        for _ in range(action.count):
            made.append((await rt.kube.create_pod(pool_ns, pod))["metadata"]["name"])
        rt.expect(pool_ns, key, made)
        await rt.event(ns, body, "ModelService", "Warning", "PoolEmpty",
                       f"{action.role}: warm pool short by {action.count}; created {', '.join(made)} (slow path)")
    elif isinstance(action, Drain):
        # routers stop sending to the pod first (they watch this annotation); the engine itself is drained
        # a round later, with its release, so no request ever arrives at a draining engine
        p = by_name[action.pod]
        try:
            await rt.kube.patch_pod(pool_ns, p.pod_name, drain_patch(p, now_iso(), action.preempted_for))
        except (Conflict, NotFound):
            return None  # re-read next round
        await serving_gate.close(rt.kube, pool_ns, await rt.pool_pods(pool_ns), p.pod_name)  # Services too
        if action.preempted_for is None:  # a preemption has its own Event (decision: Preempted)
            await rt.event(ns, body, "ModelService", "Normal", "ScaleDown", f"draining {p.pod_name}")
    elif isinstance(action, Release):
        p = by_name[action.pod]
        kept: str | None = None
        if p.endpoint:
            # O(1) host copies per model (issue 18): the first releases keep their weights in host memory
            # (a scale-from-zero source); beyond host_copies_per_model they drop them
            keep = keep_host_copy(pods, spec.model.name, p.pod_name, rt.settings.host_copies_per_model,
                                  rt.settings.node_cache)
            try:
                await rt.engines.drain(p.endpoint)  # readiness drops; requests in flight finish
                st = await rt.engines.release(p.endpoint, keep)
                kept = spec.model.name if st.get("hostCopyBytes") else None
            except EngineError as e:
                if e.status == 409:
                    return None  # requests still in flight: try again next round
                log.warning("%s", e)
        if not await unbind(rt, pool_ns, p, kept):
            return None
        if kept:
            # the round's other releases must count this copy: they read the same pod snapshot, and without
            # it every pod released in one round (a scale-down drains several at once) kept a copy
            pods[pods.index(p)] = replace(p, model_service=None, role=None, host_copy=kept)
        rt.unreserve(pool_ns, [p.pod_name])  # its claim was for the bind this release ends: it may serve again
        await rt.event(ns, body, "ModelService", "Normal", "Released", f"{p.pod_name} returned to the pool")
    return None


async def unbind(rt: Runtime, pool_ns: str, p: PodView, kept: str | None) -> bool:
    """Return a released pod to the pool. The round's view of a draining pod is often a version behind (its
    serving gate and Ready condition change while it drains): on a 409 the pod is read again and, still bound
    to the same service and draining, unbound at its current version (the engine is released already; waiting
    a round per conflict kept a preempted engine from its taker for seconds under load)."""
    try:
        await rt.kube.patch_pod(pool_ns, p.pod_name, unbind_patch(p, host_copy=kept))
        return True
    except NotFound:
        return False
    except Conflict:
        pass
    try:
        cur = pod_view(await rt.kube.get_pod(pool_ns, p.pod_name))
        if cur.model_service != p.model_service or not cur.draining:
            return False  # changed meanwhile: re-read next round
        await rt.kube.patch_pod(pool_ns, p.pod_name, unbind_patch(cur, host_copy=kept))
        return True
    except (Conflict, NotFound):
        return False


async def act(rt: Runtime, w: World, d: Decision) -> None:
    """Carry out `d`, decided on `w`: every write of the round."""
    ns, name, body = w.ns, w.name, dict(w.body)
    key = (ns, name)
    if w.spec is None:  # refused: reported once per generation; a spec change (kopf update) retries
        if d.invalid_generation is not None:
            rt.invalid_seen[key] = d.invalid_generation
            for e in d.events:
                await rt.event(ns, body, "ModelService", e.type, e.reason, e.message)
            if d.status is not None:
                await rt.kube.patch_modelservice_status(ns, name, dict(d.status))
        rt.steady[key] = (d.interval, True)
        rt.fleet_board(rt.pool_namespace(ns)).remove(service_key(ns, name, rt.pool_namespace(ns)))
        return
    for a in d.actions:  # no await before these claims (observe.py)
        if isinstance(a, CreatePlan):
            rt.reserve(w.pool_ns, (*a.targets, *a.sources))  # idle host-copy sources too (decision.held_pods)
    rt.last_round[key] = w.now
    rt.invalid_seen.pop(key, None)
    for role, (below, busy) in d.clocks.items():
        rt.below_since[(ns, name, role)] = below
        if busy is not None:
            rt.last_busy[(ns, name, role)] = busy
    rt.host_copy_checked.update({(w.pool_ns, p): w.now for p in w.copy_checks})
    rt.steady[key] = (d.interval, not d.moving)
    rt.metrics.pool_size.labels(w.pool_ns).set(sum(1 for p in w.pods if p.model_service is None))
    for c in d.changes:
        rt.metrics.decisions.labels(ns, name, c.role, c.policy, "up" if c.desired > c.current else "down").inc()
        # the same decision in every round of a wait (a short pool, a plan in flight) logs at INFO once a minute
        last = rt.decision_logged.get((ns, name, c.role))
        again = last is not None and last[:2] == (c.current, c.desired) and w.now - last[2] < DECISION_LOG_S
        if not again:
            rt.decision_logged[(ns, name, c.role)] = (c.current, c.desired, w.now)
        log.log(logging.DEBUG if again else logging.INFO, "%s/%s decision %s %d -> %d: %s", ns, name, c.role,
                c.current, c.desired, c.reason)
    log.debug("%s/%s round: %s", ns, name, ", ".join(d.moving) or "steady")
    assert d.result is not None
    rt.metrics.observe_service(ns, name, d.result.roles, active_plan_ages(w.plans, name))
    if d.conversions is not None:  # disaggregated: convertible decoders (TokenScale)
        await converter.carry_out(rt, body, w.key, w.pods, d.conversions)
    pods = list(w.pods)  # apply() records the round's host copies in it (one Release keeps, the next counts it)
    decided_at = time.perf_counter()
    for e in d.events:
        await rt.event(ns, body, "ModelService", e.type, e.reason, e.message)
    for a in d.actions:
        await apply(rt, body, w.spec, pods, a, decided_at)
    await hostcopykeeper.carry_out(rt, body, w.spec.model.name, d.copies, w.pods, w.pool_ns)
    await recovery.carry_out(rt, body, w.pool_ns, w.pods, d.health)
    await write_gates(rt, w.pool_ns, d.gates, d.labels)
    if d.status is not None:
        # unchanged status is not written: at a sub-second interval every write is a watch event for
        # every ModelService watcher, and the API server is the record, not the fast path
        await rt.kube.patch_modelservice_status(ns, name, dict(d.status))
    for oname, st in d.role_statuses:
        with contextlib.suppress(NotFound):  # deleted meanwhile: nothing to report to
            await rt.kube.patch_modelservicerole_status(ns, oname, dict(st))
    for plan in d.prune:
        with contextlib.suppress(NotFound):
            await rt.kube.delete_scaleplan(ns, plan)
    if d.post is not None:  # the ask the next arbitration of the pool reads (fleetboard.py)
        wake = set(d.wake)  # donors preempted for this service: their rounds drain the replicas
        board = rt.fleet_board(w.pool_ns)
        if board.post(w.key, d.post) and board.short(w.fleet.free if w.fleet is not None else 0):
            # this ask made (or keeps) the pool short: the services that may give run their rounds now, on it
            wake.update(board.donors(w.key))
        for donor in sorted(wake):
            rounds.wake(rt, *rounds.service_of(donor, w.pool_ns))


async def write_gates(rt: Runtime, pool_ns: str, gates: Iterable[tuple[str, bool]],
                      labels: Iterable[tuple[str, bool]]) -> None:
    """The serving gates and labels that differ from the pods' bindings (serving_gate.py)."""
    for pod, open_ in gates:
        await serving_gate.write(rt.kube, pool_ns, pod, open_, "Serving" if open_ else "NotServing")
    for pod, open_ in labels:
        await serving_gate.write_label(rt.kube, pool_ns, pod, open_)


def active_plan_ages(plans: Iterable[Mapping[str, Any]], service: str) -> list[float]:
    """Seconds since creation of the service's unfinished ScalePlans (for the scale-up-stuck alert)."""
    now = datetime.now(UTC)
    return [(now - datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))).total_seconds()
            for p in plans if ((p.get("spec") or {}).get("modelServiceRef") or {}).get("name") == service
            and (p.get("status") or {}).get("phase") not in TERMINAL and p["metadata"].get("creationTimestamp")]
