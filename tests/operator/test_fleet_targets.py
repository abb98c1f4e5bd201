"""The shared pool's target choice in decide() (fleettargets.py on the planner's choose_fleet_targets): hand-built
Worlds in, the plan's targets out. An engine whose node's GPU type the service does not select is never bound;
an engine on a node already keeping the model's host copy (node cache) comes first; one on a node keeping
another model's copy comes last; without the node cache a pod keeping this model's own copy stays a host
source; a stated GPU memory need (spec.engine.gpuMemoryGiB) binds only engines whose GPUs hold it, the least
left over first; with no memory need stated the smallest GPUs go first."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from builders import pod, spec
from pydantic import ValidationError
from test_decide_world import CONC, NOW, world

from kascade_operator.decision import decide
from kascade_operator.fleettargets import FleetTargets, node_class
from kascade_operator.reconcile import CreatePlan
from kascade_operator.settings import OperatorSettings
from kascade_planner import policies as P

GPU, MEM = "nvidia.com/gpu.product", "nvidia.com/gpu.memory"
LOAD = P.MetricsSnapshot(NOW, in_flight=6)  # concurrency 4 per instance: 1 -> 2 replicas


def plan_of(d: Any) -> CreatePlan:
    plans = [a for a in d.actions if isinstance(a, CreatePlan)]
    assert len(plans) == 1, d.actions
    return plans[0]


def serving_and(*idle: Any) -> list[Any]:
    return [pod("s0", "n0", ms="svc", role="colocated", ready=True), *idle]


def test_an_engine_on_a_gpu_type_the_service_does_not_select_is_never_bound() -> None:
    s = spec(hi=4, scaling=CONC, engine={"nodeSelector": {GPU: "H100"}})
    labels = {"n0": {GPU: "H100"}, "m0": {GPU: "A100"}, "m1": {GPU: "H100"}}
    d = decide(world(s, serving_and(pod("i0", "m0"), pod("i1", "m1")), LOAD, node_labels=labels))
    assert plan_of(d).targets == ("i1",)  # i0 first by name, on an A100
    # only A100s idle: no plan binds them; the pool is short by one (a fallback pod, with the selector, would be
    # created where the pod policy allows it)
    d = decide(world(s, serving_and(pod("i0", "m0")), LOAD, node_labels=labels))
    assert not [a for a in d.actions if isinstance(a, CreatePlan)]
    assert d.result is not None and d.result.short == 1
    # a node this operator does not know (not in its node list) fits no selector; without one it fits
    assert not [a for a in decide(world(s, serving_and(pod("i0", "m9")), LOAD, node_labels=labels)).actions
                if isinstance(a, CreatePlan)]
    assert plan_of(decide(world(spec(hi=4, scaling=CONC), serving_and(pod("i0", "m9")), LOAD,
                                node_labels=labels))).targets == ("i0",)


def test_with_the_node_cache_a_node_keeping_the_models_copy_comes_first() -> None:
    s = spec(hi=4, scaling=CONC)
    keeper = dataclasses.replace(pod("k", "m2", ms="other", role="colocated", ready=True), host_copy="m")
    pods = serving_and(pod("i0", "m0"), pod("i1", "m1"), pod("i2", "m2"), keeper)
    cache = OperatorSettings(engine_token="t", node_cache=True)
    assert plan_of(decide(world(s, pods, LOAD, settings=cache))).targets == ("i2",)  # not i0: m2 keeps m's copy
    # without the node cache the copy is k's own: it says nothing of i2, the pool's order stands
    assert plan_of(decide(world(s, pods, LOAD))).targets == ("i0",)


def test_a_node_keeping_another_models_copy_is_left_to_that_model() -> None:
    s = spec(hi=4, scaling=CONC)
    other = dataclasses.replace(pod("a", "m0"), host_copy="other")  # an idle engine keeping another model
    pods = serving_and(other, pod("i0", "m0"), pod("i1", "m1"))
    cache = OperatorSettings(engine_token="t", node_cache=True)
    assert plan_of(decide(world(s, pods, LOAD, settings=cache))).targets == ("i1",)  # m0 keeps "other"
    assert plan_of(decide(world(s, pods, LOAD))).targets == ("i0",)  # private copies: only a's own is avoided


def test_without_the_node_cache_a_pod_keeping_this_models_copy_sends_and_is_not_bound() -> None:
    s = spec(hi=4, scaling=CONC)
    mine = dataclasses.replace(pod("a", "m0"), host_copy="m")
    plan = plan_of(decide(world(s, serving_and(mine, pod("i1", "m1")), LOAD)))
    assert plan.targets == ("i1",) and plan.sources == ("s0", "a")
    # when it is the only idle engine it is bound all the same
    assert plan_of(decide(world(s, serving_and(mine), LOAD))).targets == ("a",)


def test_with_no_memory_need_stated_the_smallest_gpus_go_first() -> None:
    s = spec(hi=4, scaling=CONC)
    labels = {"m0": {GPU: "H100", MEM: "81920"}, "m1": {GPU: "L4", MEM: "24576"}}
    d = decide(world(s, serving_and(pod("i0", "m0"), pod("i1", "m1")), LOAD, node_labels=labels))
    assert plan_of(d).targets == ("i1",)


def test_a_stated_gpu_memory_need_binds_only_engines_whose_gpus_hold_it() -> None:
    labels = {"m0": {GPU: "L4", MEM: "24576"}, "m1": {GPU: "H100", MEM: "81920"}, "m2": {GPU: "X"}}
    pods = serving_and(pod("i0", "m0"), pod("i1", "m1"), pod("i2", "m2"))
    s = spec(hi=4, scaling=CONC, engine={"gpuMemoryGiB": 40})
    assert plan_of(decide(world(s, pods, LOAD, node_labels=labels))).targets == ("i1",)  # L4: 24 GiB < 40
    small = spec(hi=4, scaling=CONC, engine={"gpuMemoryGiB": 20})
    assert plan_of(decide(world(small, pods, LOAD, node_labels=labels))).targets == ("i0",)  # least left over
    # a node that does not say its GPU memory is not bound for a stated need
    d = decide(world(s, serving_and(pod("i2", "m2")), LOAD, node_labels=labels))
    assert not [a for a in d.actions if isinstance(a, CreatePlan)] and d.result is not None and d.result.short == 1


@pytest.mark.parametrize("bad", [0, -1, "40", True])
def test_gpu_memory_need_is_a_positive_number_and_the_error_names_the_field(bad: Any) -> None:
    with pytest.raises(ValidationError, match="gpuMemoryGiB"):
        spec(engine={"gpuMemoryGiB": bad})


def test_node_class_from_the_gpu_labels() -> None:
    c = node_class({GPU: "NVIDIA-H100-80GB-HBM3", MEM: "81559"}, gpus=2)
    assert (c.gpu_type, round(c.gpu_memory_gib, 2), c.gpus_per_engine, c.memory_gib > 159) == \
        ("NVIDIA-H100-80GB-HBM3", 79.65, 2, True)
    bare = node_class({MEM: "lots"})
    assert bare.gpu_type == "unlabelled" and bare.name == "unlabelled/?MiB/x1"


@pytest.mark.parametrize("k", [0, -1])
def test_nothing_asked_nothing_chosen(k: int) -> None:
    assert FleetTargets("m").choose([pod("i0", "m0")], k, ()) == []
