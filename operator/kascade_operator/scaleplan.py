"""ScalePlans: from a reconcile `CreatePlan` action to a planner `Plan`, to the ScalePlan CR, and back
from engine statuses to the ScalePlan status.

Data flow: CreatePlan + pods (PodView) + Node dicts -> `build()` (planner: topology from live node
labels, chains/binomial/star, or `local` for the first copy) -> `spec_dict()` (ScalePlan spec, owned
by the ModelService) -> handlers create it, bind targets, instruct engines -> engine `status` dicts ->
`progress()` -> status dict; `Throttle` keeps status writes at most one per interval (phase changes
always go through). Resume after a restart: the status lists which targets were already instructed;
`to_instruct()` returns only the others, so each engine is told exactly once per plan.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kascade_operator.pool import PodView
from kascade_operator.reconcile import CreatePlan
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import LabelKeys, Topology, topology_from_nodes
from kascade_planner.tpgroup import unsharded

DEFAULT_LAYERS = 32
DEFAULT_BLOCK_BYTES = 64 << 20  # a planning estimate when the model size is unknown


@dataclass(frozen=True)
class Built:
    plan: Plan
    pods: Mapping[str, PodView]  # instance id -> pod (sources and targets)
    # targets that load from their node's copy (node cache), not by `plan`: instance -> predicted seconds (the
    # local copy's upload time). In no flow of a transfer plan; in a `local` plan when no target is left to it.
    node_copy: Mapping[str, float] = field(default_factory=dict)


def node_copy_nodes(pods: Iterable[PodView], model: str, node_cache: bool) -> frozenset[str]:
    """Nodes whose cache keeps `model`'s copy: a pool pod there records it (the rule fleettargets.FleetTargets
    prefers targets by). Fallback pods have no node cache; without one (`node_cache` False) there are none."""
    if not node_cache:
        return frozenset()
    return frozenset(p.node for p in pods if p.node and p.host_copy == model and p.created_for is None)


def layout(model: str, layers: int | None, total_bytes: int | None = None,
           manifest: Mapping[str, Mapping[str, Any]] | None = None) -> ModelLayout:
    """The model's blocks as the planner sees them: the real ids and sizes from a source engine's
    manifest when one is known, else a uniform estimate from `spec.model.layers`."""
    if manifest:
        ids = tuple(manifest)
        if ids[:1] != ("embed",) or ids[-1:] != ("head",):
            raise ValueError(f"manifest of {model}: blocks must run embed, layer.0.., head; got {ids[:1]}..{ids[-1:]}")
        return ModelLayout(model, ids, tuple(int(manifest[b]["bytes"]) for b in ids))
    n = layers or DEFAULT_LAYERS
    return ModelLayout.uniform(model, n, total_bytes or DEFAULT_BLOCK_BYTES * (n + 2))


def build(action: CreatePlan, pods: Mapping[str, PodView], nodes: Sequence[Mapping[str, Any]], model: ModelLayout,
          algorithm: str, tp: int, keys: LabelKeys = LabelKeys(), inter_leaf_ratio: float = 1.0,
          live: bool = False, copy_nodes: Collection[str] = (), topo: Topology | None = None) -> Built:
    """Plan `action` on the live topology. No sources -> each target loads from its own node (`local`).
    `live`: pair each target with a serving source to execute its loaded layers while it loads. `copy_nodes`:
    nodes whose cache keeps the model's copy (`node_copy_nodes`): a target there (tp 1, as the engine's node cache;
    not a fallback pod; not keeping a copy itself, which binds from its own) loads from that copy and is no target
    of the transfer; its predicted time is the copy's upload on its node. When every target does, the plan is
    `local`. `topo`: the topology of `nodes` when the caller keeps one (Runtime.topology), else parsed here."""
    if topo is None:
        topo = topology_from_nodes(nodes, keys, inter_leaf_ratio)

    def inst(name: str, source: bool = False) -> Instance:
        p = pods[name]
        if not p.node:
            raise ValueError(f"pod {name} has no node (spec.nodeName) yet")
        # a released pod keeping the model in host memory: a host source (its engine sends from that copy)
        host = source and p.model_service is None and p.host_copy == model.name
        return Instance(p.instance, p.node, tp, kind="host" if host else "gpu")

    srcs, tgts = [inst(s, source=True) for s in action.sources], [inst(t) for t in action.targets]
    by_copy = [t for n, t in zip(action.targets, tgts, strict=True) if tp == 1 and t.node in copy_nodes
               and pods[n].created_for is None and pods[n].host_copy != model.name]
    if by_copy:
        local = make_plan(topo, model, (), by_copy, "local", host_cached_nodes={t.node for t in by_copy})
        rest = [t for t in tgts if t not in by_copy]
        if not rest:
            return Built(local, {pods[n].instance: pods[n] for n in action.targets}, dict(local.predicted))
        inner = build(replace(action, targets=tuple(n for n in action.targets if pods[n].instance in
                                                    {t.id for t in rest})),
                      pods, nodes, model, algorithm, tp, keys, inter_leaf_ratio, live, topo=topo)
        by_id = {**inner.pods, **{t.id: pods[n] for n, t in zip(action.targets, tgts, strict=True) if t in by_copy}}
        return Built(inner.plan, by_id, dict(local.predicted))
    flows = [(pods[a].instance, pods[b].instance) for a, b in action.kv_flows if a in pods and b in pods]
    if srcs and all(s.id in {a for a, _ in flows} for s in srcs):
        flows = []  # every source sends KV: one of them must still send weights (interference accepted)
    cached = {t.node for t in tgts} if action.host_copy else ()  # the target's own node holds the copy
    serving = [s.id for s in srcs if s.kind == "gpu"]  # host sources serve nothing: never overloaded
    plan = make_plan(topo, model, srcs, tgts, algorithm if srcs else "local", overloaded=serving,
                     live=live, kv_flows=flows, host_cached_nodes=cached)
    if not live or tp > 1:  # execution pipelines are live execution too (livewiring.py runs them only when asked);
        plan = replace(plan, pipelines=())  # a TP engine as a pipeline hop is untested: TP services get pairs only
    if tp > 1:  # engines run a plan into TP targets as one rank plane per GPU (tpgroup.py; tp/planload.py)
        plan = unsharded(plan)
    by_id = {pods[n].instance: pods[n] for n in (*action.sources, *action.targets)}
    return Built(plan, by_id)


def spec_dict(b: Built, model_service: str, role: str, reason: str, source_path: str | None = None,
              dtype: str | None = None) -> dict[str, Any]:
    """The ScalePlan spec (camelCase, as the CRD declares it). Host sources (the first copy, read on the
    target's own node) carry `source_path`, the directory the ModelService's source names; `dtype` (the
    service's spec.model.dtype) goes to every target with its bind."""
    p, pods = b.plan, b.pods
    pred = dict(p.predicted)

    def src(i: Instance) -> dict[str, Any]:
        d: dict[str, Any] = {"instance": i.id, "node": i.node, "kind": "gpu" if i.kind == "gpu" else "host"}
        if i.id in pods:
            d["pod"] = pods[i.id].pod_name
        if i.kind == "host":  # host memory: a released engine's host copy on that node
            d["hostCopy"] = True
        elif d["kind"] == "host" and source_path:
            d["path"] = source_path
        return d

    spec: dict[str, Any] = {
        "modelServiceRef": {"name": model_service}, "role": role, "algorithm": p.algorithm,
        "reason": reason[:4096],
        "sources": [src(s) for s in p.sources],
        "targets": [*({"instance": t.id, "pod": pods[t.id].pod_name, "node": t.node,
                       **({"nodeCopy": True} if t.id in b.node_copy else {}),
                       **({"predictedSeconds": round(pred[t.id], 6)} if t.id in pred else {})} for t in p.targets),
                    *({"instance": i, "pod": pods[i].pod_name, "node": pods[i].node, "nodeCopy": True,
                       "predictedSeconds": round(s, 6)} for i, s in b.node_copy.items() if i not in pred)],
        "blockOrder": list(p.model.block_ids),
        "plan": p.to_dict(),
    }
    if dtype:
        spec["dtype"] = dtype
    chains = [list(c) for c in p.chains if len(c) >= 2]
    if chains:
        spec["chains"] = chains
    shards = [{"source": f.src, "target": f.dst, "index": f.shard[0], "count": f.shard[1]}
              for f in p.flows if f.shard is not None]
    if shards:
        spec["shards"] = shards
    if p.live_pairs:
        spec["livePairs"] = [{"overloaded": a, "loading": b} for a, b in p.live_pairs]
    if pred or b.node_copy:
        spec["predictedSeconds"] = round(max(p.completion, *b.node_copy.values(), 0.0), 6)
    return spec


def to_instruct(spec: Mapping[str, Any], status: Mapping[str, Any] | None) -> list[str]:
    """Target instance ids not yet instructed according to the ScalePlan status (resume exactly once)."""
    done = {t["instance"] for t in ((status or {}).get("targets") or []) if t.get("instructed")}
    return [t["instance"] for t in spec["targets"] if t["instance"] not in done]


def progress(spec: Mapping[str, Any], statuses: Mapping[str, Mapping[str, Any] | None], instructed: set[str],
             failed: Mapping[str, str], started: float, now: float) -> dict[str, Any]:
    """ScalePlan status from the targets' engine statuses (None = not reachable this round).

    `failed`: targets dropped from the plan (engine dead, load error). The plan goes on for the others
    (their chains re-fetch from a fallback source) and succeeds when every surviving target is ready;
    it fails only when no target survives. The reconciler then sees fewer replicas than desired and
    plans the missing ones anew."""
    rows, ready, nbytes = [], 0, 0
    for t in spec["targets"]:
        iid = t["instance"]
        st = statuses.get(iid) or {}
        blocks = st.get("blocks") or {}
        row: dict[str, Any] = {"instance": iid, "instructed": iid in instructed,
                               "blocksReceived": sum(1 for v in blocks.values() if v),
                               "blocksTotal": len(spec.get("blockOrder") or blocks),
                               "ready": bool(st.get("ready")) and iid not in failed}
        if st.get("bytesReceived") is not None:
            row["bytesReceived"] = int(st["bytesReceived"])
            nbytes += int(st["bytesReceived"])
        if iid in failed:
            row["failed"] = failed[iid][:500]
        ready += row["ready"]
        rows.append(row)
    n, alive = len(rows), len(rows) - sum(1 for r in rows if "failed" in r)
    if alive == 0:
        phase = "Failed"
    elif ready == alive:
        phase = "Succeeded"
    elif instructed:
        phase = "Live" if spec.get("livePairs") else "Transferring"
    else:
        phase = "Pending"
    out: dict[str, Any] = {
        "phase": phase,
        "targets": rows,
        "targetsReady": f"{ready}/{n}",
        "progress": f"{sum(r['blocksReceived'] for r in rows)}/{sum(r['blocksTotal'] for r in rows)}",
    }
    if failed:
        out["message"] = "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))[:2000]
    if phase in ("Succeeded", "Failed"):
        dur = max(now - started, 0.0)
        out["durationSeconds"] = round(dur, 6)
        if phase == "Succeeded" and dur > 0 and nbytes:
            out["bandwidthGbps"] = round(nbytes * 8 / dur / 1e9, 6)
    return out


class Throttle:
    """At most one status write per `interval_s`, except when the phase changes."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self._interval, self._clock = interval_s, clock
        self._last_t: float | None = None
        self._last_phase: str | None = None

    def should_write(self, phase: str) -> bool:
        now = self._clock()
        if phase != self._last_phase or self._last_t is None or now - self._last_t >= self._interval:
            self._last_t, self._last_phase = now, phase
            return True
        return False
