"""Live wiring: which engines of a ScalePlan cooperate with which while they load, and telling them.

Two shapes of live execution come out of a plan (kascade_planner):
- **live pairs** (BlitzScale §5, `plan.livePairs`): a loading target runs the layers it holds for its
  requests and ships activations to its overloaded serving source, which finishes them. The target is
  told `cooperate {peer: source's activation port, mode: zigzag, zigzag: setting}` right after its
  load-plan, so its scheduler follows the planner's ZigZag schedule.
- **execution pipelines** (λScale Alg. 2, `plan.pipelines`, binomial plans): receivers that got
  different blocks first serve together before any holds the whole model. Member 0 (embed and the first
  chunk) batches the requests and runs its prefix, member j runs the layers it holds and passes the rows
  to member j+1 (`cooperate mode: pipeline`), the member that reaches the last layer and holds the head
  samples. A pipeline may only take requests once its members together cover every layer in order, so:
  at instruct time each member only warms its hop (`standby`: connect + hello now, not on the critical
  path); on each driver poll `advance` checks coverage from the engines' block statuses and, when
  covered, forms the hops tail first, then the head, then annotates the head live (routers send it
  requests). A member dropped from the plan: the rest re-form when they still cover; otherwise the head
  stops cooperating (its readiness goes, the live annotation is removed). A member that completes serves
  alone; the head completing dissolves the pipeline (the engine falls back to local execution).

Data flow: ScalePlan spec (+ plan dict) and pods (PodView) -> pure `pipelines_of` / `chain_to_form` /
`zigzag_for` -> async `instructed` (hook after a target's load-plan) and `advance` (hook in the driver's
poll, with the engine statuses it already fetched) -> EngineClient.cooperate -> pod annotation
`kascade.io/live`. Stateless across operator restarts: what is formed is read back from the engines'
statuses (`cooperate.peer`, `pipelineDownstream`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kascade_operator import labels as L
from kascade_operator.engine_client import EngineError
from kascade_operator.kube import Conflict, NotFound
from kascade_operator.pool import PodView
from kascade_operator.runtime import Runtime
from kascade_planner.engine_api import ZigZagSpec

log = logging.getLogger(__name__)

Status = Mapping[str, Any]


def pipelines_of(plan: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The plan's execution pipelines of two or more members (member order = layer order)."""
    return [tuple(str(m) for m in p) for p in plan.get("pipelines") or [] if len(p) >= 2]


def _prefix(blocks: Mapping[str, bool], start: int, layers: int) -> int:
    """The layer after the run of resident layers start, start+1, ... (the engine's rule per row)."""
    at = start
    while at < layers and blocks.get(f"layer.{at}"):
        at += 1
    return at


def chain_to_form(members: Sequence[str], statuses: Mapping[str, Status | None]) -> tuple[str, ...] | None:
    """The members (head first, in member order) that can serve together now, or None.

    The engine's rules: the head needs `embed` and runs its resident prefix 0..k-1; each next member
    runs the layers it holds from where the previous stopped; the member at which rows reach the last
    layer must hold `head` (it samples), else a later one must. Members that would add no layer are
    left out (no idle hop). Coverage only grows as blocks land, so once a chain serves it keeps serving
    until a member dies. A head that holds everything needs no pipeline (None)."""
    head = statuses.get(members[0]) if members else None
    if not head:
        return None
    blocks = head.get("blocks") or {}
    layers = sum(1 for b in blocks if b.startswith("layer."))
    if not blocks.get("embed") or layers == 0:
        return None
    at = _prefix(blocks, 0, layers)
    if at == layers and blocks.get("head"):
        return None  # complete: serves alone
    chain = [members[0]]
    for m in members[1:]:
        st = statuses.get(m)
        if not st:
            return None  # unknown this round: decide next round
        b = st.get("blocks") or {}
        nxt = _prefix(b, at, layers)
        if nxt > at or (nxt == layers and b.get("head")):
            chain.append(m)
            at = nxt
        if at == layers and b.get("head"):
            return tuple(chain)
    return None


def formed_chain(members: Sequence[str], statuses: Mapping[str, Status | None],
                 act: Mapping[str, str]) -> tuple[str, ...]:
    """The pipeline the engines run now, read back from their statuses: the head's `cooperate.peer`,
    then each hop's `pipelineDownstream` (members by activation endpoint); () when the head is not
    cooperating. A hop to an endpoint of no member ends the walk with "?"."""
    by_act = {ep: m for m, ep in act.items() if m in members}
    head = statuses.get(members[0]) or {}
    peer = (head.get("cooperate") or {}).get("peer")
    chain = [members[0]] if peer else []
    while peer:
        m = by_act.get(peer, "?")
        if m in chain:
            break
        chain.append(m)
        peer = (statuses.get(m) or {}).get("pipelineDownstream") if m != "?" else None
    return tuple(chain)


def zigzag_for(spec: Mapping[str, Any], target: str, layer_seconds: float, batches: int,
               ilp: bool) -> ZigZagSpec | None:
    """The ZigZag setting of a live pair: loadRatio = the plan's predicted seconds per block for this
    target over the time a serving engine needs for one layer of one batch; None without a prediction."""
    row = next((t for t in spec.get("targets") or [] if t.get("instance") == target), None)
    n = len(spec.get("blockOrder") or [])
    if not row or row.get("predictedSeconds") is None or n == 0:
        return None
    per_block = float(row["predictedSeconds"]) / n
    return ZigZagSpec(min(max(per_block / layer_seconds, 0.0), 1e6), batches, ilp)


async def _annotate_live(rt: Runtime, ns: str, pod: PodView, live: bool) -> None:
    try:
        await rt.kube.patch_pod(ns, pod.pod_name, {"metadata": {"annotations": {L.LIVE: "true" if live else None}}})
    except (Conflict, NotFound) as e:
        log.warning("live annotation on %s: %s", pod.pod_name, e)


async def instructed(rt: Runtime, ns: str, spec: Mapping[str, Any], iid: str, pod: PodView,
                     by_inst: Mapping[str, PodView]) -> None:
    """Right after target `iid` accepted its load-plan: a pipeline member warms its hop to the next
    member (the hop forms later, in `advance`); a live-paired target forms its pair now (ZigZag). Best
    effort: when a call fails the target still loads, it just serves later."""
    plan = spec.get("plan") or {}
    assert pod.endpoint is not None
    for members in pipelines_of(plan):
        if iid in members[:-1]:
            nxt = by_inst.get(members[members.index(iid) + 1])
            if nxt is not None and nxt.act_endpoint:
                try:
                    await rt.engines.cooperate(pod.endpoint, nxt.act_endpoint, "standby")
                except EngineError as e:
                    log.warning("warming %s -> %s: %s", pod.pod_name, nxt.pod_name, e)
            return
        if iid in members:
            return
    source = next((by_inst.get(a) for a, b in plan.get("livePairs") or [] if b == iid), None)
    if source is None or not source.act_endpoint:
        return
    s = rt.settings
    zz = zigzag_for(spec, iid, s.live_layer_seconds, s.live_zigzag_batches, s.live_zigzag_ilp)
    try:
        await rt.engines.cooperate(pod.endpoint, source.act_endpoint, "zigzag", zz)
    except EngineError as e:
        log.warning("live pairing %s with %s: %s", pod.pod_name, source.pod_name, e)
        return
    await _annotate_live(rt, ns, pod, True)


async def advance(rt: Runtime, ns: str, spec: Mapping[str, Any], statuses: Mapping[str, Status | None],
                  by_inst: Mapping[str, PodView], dropped: Mapping[str, str]) -> None:
    """One driver round for the plan's pipelines: form each that its living members now cover (tail
    first, head last), re-form around dropped members, stop a head whose pipeline no longer covers."""
    for members in pipelines_of(spec.get("plan") or {}):
        if members[0] in dropped:
            continue  # the head's requests went with it; the other members load and serve alone
        living = tuple(m for m in members if m not in dropped)
        head = by_inst.get(living[0])
        head_st = statuses.get(living[0])
        if head is None or head.endpoint is None or not head_st:
            continue
        coop = head_st.get("cooperate") or {}
        act = {m: p.act_endpoint for m in members if (p := by_inst.get(m)) is not None and p.act_endpoint}
        formed = formed_chain(members, statuses, act)
        if formed and all(m in act and m not in dropped for m in formed):
            continue  # serving as formed (re-pointing a working hop would fail its in-flight rows)
        chain = chain_to_form(living, statuses)
        if chain is None:
            if coop and any(m in dropped for m in members) and not head_st.get("ready"):
                await _stop(rt, ns, head)  # a member died and the rest cannot serve: no requests to it
            continue
        pods = [by_inst.get(m) for m in chain]
        if any(p is None or p.endpoint is None or p.act_endpoint is None for p in pods):
            continue
        hops = list(itertools.pairwise(pods[1:]))  # middle members -> their next
        try:
            for mid, nxt in reversed(hops):
                assert mid is not None and nxt is not None and mid.endpoint and nxt.act_endpoint
                if (statuses.get(mid.instance) or {}).get("pipelineDownstream") != nxt.act_endpoint:
                    await rt.engines.cooperate(mid.endpoint, nxt.act_endpoint, "pipeline")
            first = pods[1]
            assert first is not None and first.act_endpoint
            if coop.get("peer") != first.act_endpoint:
                await rt.engines.cooperate(head.endpoint, first.act_endpoint, "besteffort")
                log.info("pipeline %s formed: %s", "->".join(chain), "; ".join(
                    f"{m}: {', '.join(b for b, v in ((statuses.get(m) or {}).get('blocks') or {}).items() if v)}"
                    for m in chain)[:400])
                await _annotate_live(rt, ns, head, True)
        except EngineError as e:
            log.warning("forming pipeline %s: %s (retried next round)", "->".join(chain), e)


async def _stop(rt: Runtime, ns: str, head: PodView) -> None:
    assert head.endpoint is not None
    try:
        await rt.engines.cooperate(head.endpoint, "", "off")
    except EngineError as e:
        log.warning("stopping pipeline head %s: %s", head.pod_name, e)
        return
    await _annotate_live(rt, ns, head, False)
