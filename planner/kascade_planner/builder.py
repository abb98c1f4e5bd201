"""One entry point for every plan: `make_plan(...)` dispatches to an algorithm, validates the result,
pairs loading targets with serving sources for live execution, and attaches the cost model's
predicted completion per target."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from kascade_planner.auto import choose
from kascade_planner.baselines import build_local, build_star, build_tree
from kascade_planner.binomial import build_binomial
from kascade_planner.chains import ChainOptions, build_chains
from kascade_planner.cost import CostParams, with_prediction
from kascade_planner.hybrid import build_hybrid
from kascade_planner.plan import ALGORITHMS, Instance, ModelLayout, Plan, PlanError
from kascade_planner.sharding import shard_plan
from kascade_planner.topology import Topology


def make_plan(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
              algorithm: str = "auto", *, kv_flows: Sequence[tuple[str, str]] = (), overloaded: Sequence[str] = (),
              host_cached_nodes: Collection[str] = (), shard: bool = True, predict: bool = True,
              cost: CostParams = CostParams(), live: bool | None = None, stripes: int = 2) -> Plan:
    """`algorithm` "auto" builds the candidates and keeps the fastest predicted (`auto.choose`; its
    note says why). `live`: True pairs targets with serving sources (`pair_live`), False drops pairs,
    None keeps what the algorithm chose. `stripes`: the hybrid plan's stripe count. `shard`: chain,
    hybrid and binomial hops to tp=g targets use all g GPU links (`sharding.shard_plan`)."""
    if algorithm == "auto":
        plan = choose(topo, model, sources, targets, kv_flows, overloaded, shard, cost)
    elif algorithm == "hybrid":
        plan = build_hybrid(topo, model, sources, targets, stripes, kv_flows)
        plan = shard_plan(plan, topo) if shard else plan
    elif algorithm == "chain":
        plan = build_chains(topo, model, sources, targets, kv_flows, overloaded, ChainOptions(shard=shard))
    elif algorithm == "binomial":
        plan = build_binomial(model, sources, targets, topo=topo, cost=cost, kv_flows=kv_flows)
        plan = shard_plan(plan, topo) if shard else plan
    elif algorithm == "star":
        plan = build_star(model, sources, targets)
    elif algorithm == "tree":
        plan = build_tree(model, sources, targets)
    elif algorithm == "local":
        plan = build_local(model, targets, host_cached_nodes)
    else:
        raise PlanError(f"unknown algorithm {algorithm!r} (choose one of auto, {', '.join(ALGORITHMS)})")
    plan.validate()
    if live is not None:
        plan = replace(plan, live_pairs=pair_live(plan, overloaded) if live else ())
    return with_prediction(plan, topo, cost) if predict else plan


def pair_live(plan: Plan, overloaded: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """(overloaded source, loading target) pairs for live execution (BlitzScale §5), one to one: while
    a target loads, it runs the layers it already holds for requests redirected from its pair, which
    runs the rest. Overloaded sources pair first; each with the first target of its own chain (the
    earliest to hold layers; activations then flow against the weights, on the idle direction of the
    same links), else with the next unpaired target. No serving source (first copy): no pairs."""
    serving = [s.id for s in plan.sources if s.kind == "gpu"]
    hot = set(overloaded)
    order = [s for s in serving if s in hot] + [s for s in serving if s not in hot]
    first = {c[0]: c[1] for c in plan.chains if len(c) > 1}
    pairs: list[tuple[str, str]] = []
    used: set[str] = set()
    for s in order:
        t = first.get(s)
        if t is None or t in used:
            t = next((x.id for x in plan.targets if x.id not in used), None)
        if t is None:
            break
        pairs.append((s, t))
        used.add(t)
    return tuple(pairs)
