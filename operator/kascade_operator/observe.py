"""The observe step of a round: every read of one ModelService's round, frozen into a `World` (world.py).

Data flow: the ModelService body (the watch's) -> its spec, validated (a refused spec ends the reads: the
World carries the field errors) -> its ModelServiceRoles (kopf index) -> whether a timer round is due yet
(`None` when not: nothing else is read) -> node facts, pool pods and ScalePlans (kopf indexes) -> each
role's engine metrics (the shared sweep's view, else a scrape or Prometheus) -> the router's demand ->
the engines of pods recorded as keeping a host copy (each at most every hostcopykeeper.CHECK_S) -> the
engines of idle pods dropped as unhealthy whose retry time has come (recovery.py) -> the
plans of other namespaces when the pool is shared -> LAST, with no await after it, the claims other
rounds hold (Runtime.reserved), the fallback pods still expected and the pool's fleet arbitration
(fleetboard.py, over the asks every service sharing the pool left): decide() runs on them and act()
claims its own targets before it first awaits, so two services never pick one pod.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from kascade_operator import recovery
from kascade_operator import roleobject as R
from kascade_operator.api import ModelServiceSpec
from kascade_operator.engine_client import EngineError
from kascade_operator.hostcopykeeper import CHECK_S
from kascade_operator.kube import now_iso
from kascade_operator.metrics import InstanceLoad, snapshot
from kascade_operator.pool import PodView, service_key
from kascade_operator.reconcile import role_bounds, role_want
from kascade_operator.runtime import Runtime
from kascade_operator.validation import semantic_errors
from kascade_operator.world import RoleWorld, World
from kascade_planner import policies as P

log = logging.getLogger(__name__)

MAX_NAME = 63  # the name is a label value on pods and ScalePlans (kascade.io/model-service)


def field_errors(e: ValidationError) -> str:
    """'spec.replicas.colocated.min: Input should be ...; ...' — the field path the user must fix."""
    return "; ".join(f"{'.'.join(str(x) for x in ('spec', *err['loc']))}: {err['msg']}" for err in e.errors())


async def pool_views(rt: Runtime, pool_ns: str) -> tuple[list[PodView], list[dict[str, Any]]]:
    """The pool as views (a draining pod counts as drained: its release is tried every round, 409 = requests
    still in flight) and as the watch holds it."""
    leaf, _ = await rt.node_facts()
    raw = await rt.pool_pods(pool_ns)
    return [replace(p, drained=True) if p.draining else p for p in rt.pod_views(raw, leaf)], raw


async def copy_checks(rt: Runtime, pods: list[PodView], model: str, pool_ns: str,
                      now: float) -> dict[str, int | None]:
    """hostCopyBytes of the engines of pods recorded as keeping `model`, each read at most every CHECK_S
    (None: the engine did not answer; its record stays)."""
    out: dict[str, int | None] = {}
    for p in pods:
        if p.host_copy != model or p.unhealthy or not p.endpoint:
            continue
        if now - rt.host_copy_checked.get((pool_ns, p.pod_name), -1e9) < CHECK_S:
            continue
        try:
            out[p.pod_name] = int((await rt.engines.status(p.endpoint)).get("hostCopyBytes") or 0)
        except EngineError as e:
            log.debug("host copy of %s on %s not checked: %s", model, p.pod_name, e)
            out[p.pod_name] = None
    return out


async def parse(rt: Runtime, body: dict[str, Any]) -> tuple[ModelServiceSpec | None, list[str]]:
    """The validated spec and its problems (field errors, semantic ones against the nodes), parsed again
    only when the spec or the nodes' largest GPU count changed (a steady round reads the same spec)."""
    meta, raw = body["metadata"], body.get("spec") or {}
    _, gpus = await rt.node_facts()
    key = (meta["namespace"], meta["name"])
    hit = rt.parsed.get(key)
    if hit is not None and hit[0] == raw and hit[1] == gpus:
        return hit[2], list(hit[3])
    problems: list[str] = []
    name = meta["name"]
    if len(name) > MAX_NAME:
        problems.append(f"metadata.name: {len(name)} characters; at most {MAX_NAME} (it is a label value on the "
                        f"service's pods and ScalePlans)")
    spec: ModelServiceSpec | None = None
    try:
        spec = ModelServiceSpec.model_validate(raw)
        problems += semantic_errors(spec, gpus, rt.settings.gpu_resource)
    except ValidationError as e:
        problems.append(field_errors(e))
    rt.parsed[key] = (copy.deepcopy(raw), gpus, spec, tuple(problems))
    return spec, problems


async def observe(rt: Runtime, body: dict[str, Any], trigger: str, limit: bool = True) -> World | None:
    """The round's World, or None when it is not due (a timer round sooner than 0.95 of the interval, unless
    `limit` is False: its metrics changed) or the service is being deleted (its delete handler releases
    everything)."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    now = time.monotonic()
    if meta.get("deletionTimestamp"):
        return None
    spec, problems = await parse(rt, body)
    if problems or spec is None:
        return World(body, trigger, now, now_iso(), rt.settings, None, tuple(problems),
                     invalid_reported=rt.invalid_seen.get((ns, name)) == meta.get("generation"))
    # per-role scale handles (ModelServiceRole: HPA/KEDA per role) set the roles' desired counts
    objs = {str(b["metadata"]["name"]): b for b in await rt.role_objects(ns)
            if ((b.get("spec") or {}).get("modelServiceRef") or {}).get("name") == name}
    resolution = R.resolve(name, spec.mode, (R.RoleObject.of(b) for b in objs.values()))
    spec, sources = R.with_role_counts(spec, resolution)
    interval = spec.scaling.interval_seconds if spec.scaling else 1.0
    if limit and trigger == "timer" and now - rt.last_round.get((ns, name), -1e9) < interval * 0.95:
        return None  # this service's own spec.scaling.intervalSeconds: the queue may wake it sooner
    pool_ns = rt.pool_namespace(ns)
    key = service_key(ns, name, pool_ns)
    # the service's pods, the idle ones and the model's host copies (snapshots.py: grouped once per change)
    pool = await rt.pool_snapshot(pool_ns)
    pods, raw = pool.select(key, spec.model.name)
    own_plans = await rt.plan_snapshot(ns)
    plans = own_plans.of(name)
    roles: list[RoleWorld] = []
    for role, b in role_bounds(spec).items():
        rkey = (ns, name, role)
        serving = [p for p in pods if p.model_service == key and p.role == role and not p.draining]
        loads: list[InstanceLoad] = []
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
        roles.append(RoleWorld(role, snap, rt.below_since.get(rkey), rt.last_busy.get(rkey),
                               {x.instance: float(x.in_flight) + x.queue_length for x in loads}))
    demand = await rt.router.get(ns, name) if rt.router is not None else None
    checks = await copy_checks(rt, pods, spec.model.name, pool_ns, now)
    health, retry = await recovery.checks(rt, pods, pool_ns, now)
    # pods unfinished plans hold: this namespace's, and every other's when the pool is shared
    held = set(own_plans.held)
    if pool_ns != ns:
        for n2 in rt.plan_namespaces():
            held |= (await rt.plan_snapshot(n2)).held if n2 != ns else set()
    labels = await rt.node_labels()
    # no await from here to act()'s claims
    reserved = frozenset(rt.reserved(pool_ns))
    # the shared pool's arbitration (fleetboard.py: cached on the board's version, None while nobody is short)
    fleet = rt.fleet_board(pool_ns).view(key, pool.free_count(reserved | held), now, rt.arbitration)
    return World(body, trigger, now, now_iso(), rt.settings, spec, (), False, sources, objs, resolution, pool_ns,
                 key, tuple(pods), tuple(raw), tuple(plans), frozenset(held), reserved,
                 rt.expected(pool_ns, key, (p.pod_name for p in pods)), tuple(roles), demand,
                 rt.router is not None, rt.view is not None and rt.prometheus is None, checks, fleet, pool.preempted,
                 {p.node: labels[p.node] for p in pods if p.node and p.node in labels},
                 health, retry)
