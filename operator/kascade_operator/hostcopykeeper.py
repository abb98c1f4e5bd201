"""Never zero host copies while a service serves (issue 18 item 5): O(1) per model, at least one.

Releases keep a copy (handlers: `pool.keep_host_copy`) and a scale from zero binds from one and keeps it
(plandriver: the bind answer's hostCopyBytes), but a service whose first copy came from the model source,
or whose copy was lost with its pod, would hold none while it serves. Each round, after the round's actions:
when no pool pod keeps a copy of the model, ask ONE of the service's ready serving engines to keep its
blockset as a host copy (POST host-copy, within its --host-cache-gib; no extra bytes, it holds that blockset
in host memory already).

Data flow: the round's pool snapshot (observe.py, with the engines' hostCopyBytes of recorded pods) ->
`surplus()` / `keeper()` (pure: which pods drop, which pod to ask; decision.copy_work) -> `carry_out()` ->
engine answer (`HostCopyAnswer`) -> the pod's annotation: kascade.io/host-copy = model when it keeps one (so
the next round counts it: idempotent), kascade.io/host-copy-refused = model when it declined (its budget;
the Event says why: it is never asked again for that model, the next round asks the next pod).

A copy lost with its engine (a container restart under a pod that keeps its annotation) would be counted for
ever: so each round the pods recorded as keeping one are read (GET status, each at most every CHECK_S), and
one whose engine answers hostCopyBytes 0 loses the record (Event HostCopyLost); the next round asks again.

A serving replica's copy is a stopgap: a released pod's copy is worth more (one more scale-up source beside the
serving replicas, on a pod that serves nothing), so a release keeps one whether or not a serving replica does
(`pool.keep_host_copy` counts released copies only), and once released pods keep `host_copies_per_model`
copies the service's serving replicas drop theirs (`surplus`: POST host-copy keep=false, record cleared, Event
HostCopyDropped). And the keeper does not ask while a release that will keep a copy is in flight (a pod of
the service draining: its release comes a round or more later; the round that drains a pod counts it as
draining, its snapshot was read before the drain). Before both, which pod kept the model after a scale-down
depended on whether a round had seen the replicas ready before the drain (issue 40).

With the pool's node cache (settings.node_cache, chart pool.nodeCache) a copy is the node's, shared by its engines
(ADR 16): `host_copies_per_model` counts nodes (`pool.copy_key`), and a release on a node whose copy is counted
keeps it (no more bytes).

Which engine: the oldest pod name among the ready, undrained, healthy ones not refused. A scale-down drains
the newest names first (`pool.choose_drain`), so the keeper is the last to be released. The operator does not
know the engines' free host budgets; an engine without room refuses and the next is asked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kascade_operator.engine_client import EngineError
from kascade_operator.kube import Conflict, NotFound
from kascade_operator.pool import PodView, copy_key, host_copy_patch, keep_host_copy

if TYPE_CHECKING:
    from kascade_operator.runtime import Runtime
    from kascade_operator.world import CopyWork

log = logging.getLogger(__name__)

CHECK_S = 10.0  # how often a pod recorded as keeping a copy has its engine's hostCopyBytes read


def copies(pods: Sequence[PodView], model: str) -> int:
    """Pool pods whose engine keeps `model` in host memory (released or serving), healthy ones only."""
    return sum(1 for p in pods if p.host_copy == model and not p.unhealthy)


def releasing(pods: Sequence[PodView], model: str, service: str, per_model: int,
              node_cache: bool = False) -> PodView | None:
    """A pod of `service` being drained whose release will keep a host copy of `model` (it is told to keep one,
    `pool.keep_host_copy`, and its engine answers, healthy and never refused one), or None."""
    return next((p for p in pods if p.model_service == service and p.draining and p.endpoint and not p.unhealthy
                 and p.host_copy_refused != model
                 and keep_host_copy(pods, model, p.pod_name, per_model, node_cache) is None),
                None)


def keeper(pods: Sequence[PodView], model: str, service: str, per_model: int,
           node_cache: bool = False) -> PodView | None:
    """The serving pod to ask for a host copy of `model`, or None: the pool keeps one already, the setting
    (`host_copies_per_model`) is 0, a release in flight will keep one (`releasing`), or no ready pod of
    `service` may be asked."""
    if per_model < 1 or copies(pods, model) > 0:
        return None
    if releasing(pods, model, service, per_model, node_cache) is not None:
        # a scale-down's drain and its release are rounds apart (and a release waits while requests are in
        # flight): asking now puts the copy on a replica that stays, and the release then drops its weights
        # (issue 40). Deferred, not skipped: a release that keeps none leaves the pool without one, and the
        # next round asks.
        return None
    asked = [p for p in pods if p.model_service == service and p.ready and not p.draining and p.endpoint
             and not p.unhealthy and p.host_copy_refused != model]
    return min(asked, key=lambda p: p.pod_name, default=None)


def surplus(pods: Sequence[PodView], model: str, service: str, per_model: int,
            node_cache: bool = False) -> list[PodView]:
    """The pods of `service` that keep a copy of `model` while they serve, once released pods keep `per_model`
    copies (healthy ones; per node with a node cache, `pool.copy_key`): a release kept one (it does not count
    serving copies, `pool.keep_host_copy`), so the stopgap copies on serving replicas are dropped and the pool
    keeps O(1) copies per model. [] otherwise."""
    released = len({copy_key(p, node_cache) for p in pods
                    if p.model_service is None and p.host_copy == model and not p.unhealthy})
    if per_model < 1 or released < per_model:
        return []
    return sorted((p for p in pods if p.model_service == service and p.host_copy == model), key=lambda p: p.pod_name)


async def carry_out(rt: Runtime, body: Mapping[str, Any], model: str, work: CopyWork,
                    pods: Sequence[PodView], pool_ns: str) -> None:
    """The round's host-copy work (decision.copy_work decided it from this snapshot): clear the records of
    lost copies, ask surplus serving copies to drop, ask the keeper to keep one and record its answer."""
    by = {p.pod_name: p for p in pods}
    for name in work.lost:
        with contextlib.suppress(Conflict, NotFound):
            await rt.kube.patch_pod(pool_ns, name, host_copy_patch(None))
        msg = f"{name} no longer keeps its host copy of {model} (its engine reports none: restarted?)"
        await rt.event(body["metadata"]["namespace"], dict(body), "ModelService", "Warning", "HostCopyLost", msg)
        log.info("%s", msg)
    for name in work.drop:
        await _drop(rt, body, model, by[name], pool_ns)
    p = by.get(work.ask or "")
    if p is None or p.endpoint is None:
        return
    try:
        ans = await rt.engines.host_copy(p.endpoint)
    except EngineError as e:  # unreachable or refused: asked again next round
        log.warning("host copy of %s on %s: %s", model, p.pod_name, e)
        return
    kept = ans.host_copy_bytes > 0
    with contextlib.suppress(Conflict, NotFound):
        await rt.kube.patch_pod(pool_ns, p.pod_name, host_copy_patch(model) if kept else host_copy_patch(None, model))
    if kept:
        msg = f"{p.pod_name} keeps a host copy of {model} while it serves ({ans.host_copy_bytes / 1e6:.1f} MB)"
        await rt.event(body["metadata"]["namespace"], dict(body), "ModelService", "Normal", "HostCopy", msg)
    else:
        msg = f"{p.pod_name} keeps no host copy of {model}: {ans.reason or 'no reason given'}"
        await rt.event(body["metadata"]["namespace"], dict(body), "ModelService", "Warning", "HostCopyRefused", msg)
    log.info("%s", msg)


async def _drop(rt: Runtime, body: Mapping[str, Any], model: str, p: PodView, pool_ns: str) -> None:
    """Ask a serving engine to drop its host copy (POST host-copy keep=false: it serves on) and clear its
    record. Unreachable: the record stays, and the next round asks again."""
    if not p.endpoint:
        return
    try:
        await rt.engines.host_copy(p.endpoint, keep=False)
    except EngineError as e:
        log.warning("host copy of %s on %s not dropped: %s", model, p.pod_name, e)
        return
    with contextlib.suppress(Conflict, NotFound):
        await rt.kube.patch_pod(pool_ns, p.pod_name, host_copy_patch(None))
    msg = f"{p.pod_name} drops its host copy of {model} while it serves: a released pod keeps one"
    await rt.event(body["metadata"]["namespace"], dict(body), "ModelService", "Normal", "HostCopyDropped", msg)
    log.info("%s", msg)
