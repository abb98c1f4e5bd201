"""Applies the convertible-decoder policy: converts decode engines to take prefill during a prefill burst
and takes them back (TokenScale). Called once per reconcile round of a disaggregated ModelService.

Data flow: pods + the round's per-role inputs -> `pdscaling.conversion_input` ->
`kascade_planner.conversion.plan_conversions` (pure) -> for each decoder to convert: the engine's
`POST /kascade/v1/convert {prefillChunkTokens: N, stepBudgetMs: T, handBackMs: H}` (its scheduler then prefills at most
N prompt tokens per step, and in a step that decodes only what its measured step cost predicts within T; H, a
quarter of spec.slo.ttftMs, bounds how long a prompt it prefills itself may lag before it hands it to a prefill
engine), THEN the pod annotation `kascade.io/convertible=true` (guarded by the pod's resourceVersion),
which makes the router send it prefill. Taking back runs the other way round: the annotation goes first
(no new prefill is routed to it), then `{prefillChunkTokens: null}`. An engine or API error leaves that
decoder as it was (logged, retried next round); an Event names every conversion and its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kascade_operator import labels as L
from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleInput
from kascade_operator.engine_client import EngineError
from kascade_operator.kube import Conflict, NotFound
from kascade_operator.pdscaling import conversion_input
from kascade_operator.pool import PodView, pod_view
from kascade_operator.runtime import Runtime
from kascade_planner.conversion import Conversions, plan_conversions

log = logging.getLogger(__name__)


def _annotation(value: str | None, rv: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"annotations": {L.CONVERTIBLE: value}}
    if rv:
        meta["resourceVersion"] = rv
    return {"metadata": meta}


async def _annotate(rt: Runtime, ns: str, p: PodView, key: str) -> None:
    """The convertible annotation, guarded by the pod's resourceVersion; on a conflict (the readiness
    prober and the serving gate write pod status often) the pod is read again and, still this service's
    decoder, patched once more with the fresh version."""
    try:
        await rt.kube.patch_pod(ns, p.pod_name, _annotation("true", p.resource_version))
    except Conflict:
        fresh = await rt.kube.get_pod(ns, p.pod_name)
        again = pod_view(fresh)
        if again.model_service != key or again.role != "decode" or again.draining:
            raise
        await rt.kube.patch_pod(ns, p.pod_name, _annotation("true", again.resource_version))


async def sync(rt: Runtime, body: dict[str, Any], spec: ModelServiceSpec, key: str, pods: Sequence[PodView],
               roles: Sequence[RoleInput]) -> Conversions | None:
    """One round of conversions for one service, decided and carried out; None when it is not disaggregated.
    (A reconcile round decides in decision.py and calls `carry_out`.)"""
    inp = conversion_input(spec, key, pods, roles)
    if inp is None:
        return None
    plan = plan_conversions(inp)
    await carry_out(rt, body, key, pods, plan)
    return plan


async def carry_out(rt: Runtime, body: Mapping[str, Any], key: str, pods: Sequence[PodView],
                    plan: Conversions) -> None:
    """Convert and take back the decoders `plan` names (engine first, then the annotation; the other way
    round when taking back); an Event names the round's conversions."""
    if not plan.changes:
        return
    meta = body["metadata"]
    ns = meta["namespace"]
    by = {p.pod_name: p for p in pods}
    done: list[str] = []
    for name in plan.convert:
        p = by[name]
        assert p.endpoint is not None  # conversion_input offers only decoders with an engine address
        try:
            await rt.engines.convert(p.endpoint, plan.chunk_tokens, plan.step_budget_s, plan.hand_back_s)
            await _annotate(rt, p.namespace or rt.pool_namespace(ns), p, key)
        except (EngineError, Conflict, NotFound) as e:
            log.warning("%s/%s: converting decoder %s failed (next round retries): %s", ns, meta["name"], name, e)
            continue
        done.append(name)
    for name in plan.revert:
        p = by[name]
        try:
            await rt.kube.patch_pod(p.namespace or rt.pool_namespace(ns), name, _annotation(None))
            if p.endpoint:
                await rt.engines.convert(p.endpoint, None)
        except (EngineError, NotFound) as e:
            log.warning("%s/%s: taking decoder %s back failed: %s", ns, meta["name"], name, e)
            continue
        done.append(name)
    if done:
        log.info("%s/%s %s", ns, meta["name"], plan.reason)
        why = "ConvertDecoders" if plan.convert else "RevertDecoders"
        await rt.event(ns, dict(body), "ModelService", "Normal", why, plan.reason[:1024])
