"""Pool pods dropped as unhealthy come back when their engines answer again, with a backoff.

A ScalePlan drops a target whose engine stayed unreachable for plandriver.UNREACHABLE_LIMIT_S and marks its pod
`kascade.io/unhealthy` (pool.usable_target: never a target while marked). Kept for good, one slow answer (a
loaded node, a GC pause, an engine restarted by its kubelet) took the pod out of the pool forever: after a few
such drops the pool was short, the failed plan's service decided "0 -> 1" every round and no plan could follow.

Data flow (one round, observe -> decide -> act):
- observe (`checks`): the round's idle unhealthy pods whose retry time has come (the operator's memory
  `Runtime.health_retry`, pool ns + pod -> (next check, backoff)) get one engine status read each, the check
  taken first (the next time pushed on) so that other services' rounds on the same pool do not ask too;
- decide (`work`, pure): an engine that answered is healed (released first when it still says it is bound);
  one that did not is retried after twice the backoff (HEAL_FIRST_S .. HEAL_MAX_S); an unhealthy pod the memory
  does not know yet (just marked, or the operator restarted) is first checked HEAL_FIRST_S on;
- act (`carry_out`): the release, the mark removed from the pod, a `Recovered` Event on the service, the memory.
The reconciler names the unhealthy pods in the service's PoolShort note while they keep it short (reconcile.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kascade_operator import labels as L
from kascade_operator.engine_client import EngineError
from kascade_operator.kube import Conflict, NotFound
from kascade_operator.pool import PodView

if TYPE_CHECKING:  # world.py imports this module; the runtime is only an argument here
    from kascade_operator.runtime import Runtime

log = logging.getLogger(__name__)

HEAL_FIRST_S = 10.0  # the first check of a pod just marked unhealthy
HEAL_MAX_S = 300.0  # the longest backoff between checks of an engine that stays silent


@dataclass(frozen=True)
class HealthWork:
    heal: tuple[tuple[str, bool], ...] = ()  # (pod, release its engine first): the engine answered
    retry: tuple[tuple[str, float, float], ...] = ()  # (pod, next check at, backoff) to remember


def candidates(pods: Iterable[PodView]) -> list[PodView]:
    """Idle pool pods held out as unhealthy that have an engine address to ask."""
    return [p for p in pods if p.unhealthy and p.endpoint and p.model_service is None and p.pool and not p.draining]


async def checks(rt: Runtime, pods: Sequence[PodView], pool_ns: str,
                 now: float) -> tuple[dict[str, Mapping[str, Any] | None], dict[str, tuple[float, float]]]:
    """(pod -> engine status read now, None: no answer) for the unhealthy pods due a check, and the memory's
    (next check, backoff) for every unhealthy pod of the round."""
    out: dict[str, Mapping[str, Any] | None] = {}
    known: dict[str, tuple[float, float]] = {}
    for p in candidates(pods):
        sched = rt.health_retry.get((pool_ns, p.pod_name))
        if sched is None:
            continue
        known[p.pod_name] = sched
        if now < sched[0]:
            continue
        # taken before the await, as a claim: the other services' rounds sharing this pool do not ask the same
        # engine meanwhile (this round's act doubles the backoff or heals the pod)
        rt.health_retry[(pool_ns, p.pod_name)] = (now + sched[1], sched[1])
        assert p.endpoint is not None
        try:
            out[p.pod_name] = await rt.engines.status(p.endpoint)
        except EngineError as e:
            log.debug("unhealthy pod %s still does not answer: %s", p.pod_name, e)
            out[p.pod_name] = None
    return out, known


def work(pods: Sequence[PodView], checked: Mapping[str, Mapping[str, Any] | None],
         known: Mapping[str, tuple[float, float]], now: float) -> HealthWork:
    """What this round does about its unhealthy pods (pure)."""
    heal: list[tuple[str, bool]] = []
    retry: list[tuple[str, float, float]] = []
    for p in candidates(pods):
        name = p.pod_name
        if name not in known:
            retry.append((name, now + HEAL_FIRST_S, HEAL_FIRST_S))
        elif name in checked:
            st = checked[name]
            if st is None:
                delay = min(HEAL_MAX_S, known[name][1] * 2)
                retry.append((name, now + delay, delay))
            else:
                heal.append((name, st.get("modelService") is not None))
    return HealthWork(tuple(heal), tuple(retry))


async def carry_out(rt: Runtime, body: Mapping[str, Any], pool_ns: str, pods: Sequence[PodView],
                    hw: HealthWork) -> None:
    """Remember the retries; release and unmark the engines that answered (one Event each on the service)."""
    for name, at, delay in hw.retry:
        rt.health_retry[(pool_ns, name)] = (at, delay)
    by_name = {p.pod_name: p for p in pods}
    meta = body["metadata"]
    for name, release in hw.heal:
        p = by_name[name]
        rt.health_retry.pop((pool_ns, name), None)
        rt.unreserve(pool_ns, [name])  # a claim of the plan that dropped it must not hold it any longer
        if release and p.endpoint:  # still bound to the plan that dropped it: idle first
            try:
                await rt.engines.release(p.endpoint, keep_host_copy=False)
            except EngineError as e:
                log.warning("releasing the recovered engine of %s: %s", name, e)
                continue  # checked again at the next round's retry time
        with contextlib.suppress(Conflict, NotFound):
            await rt.kube.patch_pod(pool_ns, name, {"metadata": {"annotations": {L.UNHEALTHY: None}}})
            await rt.event(meta["namespace"], dict(body), "ModelService", "Normal", "Recovered",
                           f"pod {name}: its engine answers again (was dropped: {p.unhealthy}); back in the pool")
