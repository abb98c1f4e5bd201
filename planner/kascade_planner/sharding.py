"""Shard planes: any multicast plan fanned out over the g GPUs of tensor-parallel targets.

Why: binomial and hybrid builders plan instance to instance, one flow per hop. A tp=g target has g
GPU links; one whole-block flow uses one of them (g times slower than the links allow). When every
target has the same g and every sender can drive g links (a GPU instance of width g, or a host copy
with at least g NICs), the plan is replicated into g planes: plane i carries shard i of every block
over the i-th GPU of every instance, on the same schedule (same flows, same steps). The planes share
no link, every relay forwards the shard it received on its own GPU, and the cost model charges each
target an all-gather of its g shards over NVLink, as for sharded chains. That is the model's arithmetic:
today's engine is one process on one device, so the data plane runs a pair's shards as parallel streams
between the same two processes and gathers nothing.

Data flow: an unsharded Plan (+ topology) -> `shard_plan` -> the same plan with every flow split into
g shard flows (steps repeated per plane), or the plan unchanged with a note saying why not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kascade_planner.chains import source_links
from kascade_planner.plan import Flow, Instance, Plan, new_flow
from kascade_planner.topology import Topology


def plane_width(sources: Sequence[Instance], targets: Sequence[Instance], topo: Topology) -> tuple[int, str]:
    """(g, reason): the number of shard planes a plan between them can use (1: none), why not when 1."""
    widths = {t.gpus for t in targets}
    if len(widths) != 1:
        return 1, f"targets of mixed widths {sorted(widths)}"
    g = widths.pop()
    if g <= 1:
        return 1, "targets have one GPU"
    for s in sources:
        links = source_links(s, topo)
        if s.kind == "ssd" or (s.kind == "gpu" and links != g) or links < g:
            return 1, f"source {s.id} ({s.kind}, {links} links) cannot drive {g} shard links"
    return g, ""


def shard_plan(plan: Plan, topo: Topology) -> Plan:
    """The plan over g shard planes (see the module docstring), or unchanged with a note."""
    g, why = plane_width(plan.sources, plan.targets, topo)
    if g == 1 and not any(t.gpus > 1 for t in plan.targets):
        return plan  # one-GPU targets: nothing to shard (decided before scanning thousands of flows)
    if any([f.shard for f in plan.flows]):
        return plan
    if g == 1:
        return replace(plan, notes=(*plan.notes, f"not sharded: {why}"))
    flows: list[Flow] = []
    steps: list[tuple[int, ...]] = []
    for k, f in enumerate(plan.flows):
        flows.extend(new_flow(f.src, f.dst, f.blocks, (i, g)) for i in range(g))
        if plan.steps:
            steps.extend([plan.steps[k]] * g)
    return replace(plan, flows=tuple(flows), steps=tuple(steps),
                   notes=(*plan.notes, f"sharded over {g} GPU planes (one shard of every block per GPU link)"))
