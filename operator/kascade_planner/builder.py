"""One entry point for every plan: `make_plan(...)` dispatches to an algorithm, validates the result
and attaches the cost model's predicted completion per target."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kascade_planner.baselines import build_local, build_star, build_tree
from kascade_planner.binomial import build_binomial
from kascade_planner.chains import ChainOptions, build_chains
from kascade_planner.cost import CostParams, with_prediction
from kascade_planner.plan import ALGORITHMS, Instance, ModelLayout, Plan, PlanError
from kascade_planner.topology import Topology


def make_plan(topo: Topology, model: ModelLayout, sources: Sequence[Instance], targets: Sequence[Instance],
              algorithm: str = "chain", *, kv_flows: Sequence[tuple[str, str]] = (), overloaded: Sequence[str] = (),
              host_cached_nodes: Collection[str] = (), shard: bool = True, predict: bool = True,
              cost: CostParams = CostParams()) -> Plan:
    if algorithm == "chain":
        plan = build_chains(topo, model, sources, targets, kv_flows, overloaded, ChainOptions(shard=shard))
    elif algorithm == "binomial":
        plan = build_binomial(model, sources, targets)
    elif algorithm == "star":
        plan = build_star(model, sources, targets)
    elif algorithm == "tree":
        plan = build_tree(model, sources, targets)
    elif algorithm == "local":
        plan = build_local(model, targets, host_cached_nodes)
    else:
        raise PlanError(f"unknown algorithm {algorithm!r} (choose one of {', '.join(ALGORITHMS)})")
    plan.validate()
    return with_prediction(plan, topo, cost) if predict else plan
