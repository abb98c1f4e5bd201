"""spec.engine.tp end to end in the operator's pure parts (issue 34): a TP-g service's fallback pod runs
`--tp g` with one data port per rank (dataPort + r) and g GPUs, is annotated so only TP-g services bind it (and
TP-g services bind nothing else), is refused where its planes could not run, and its ScalePlan carries an unsharded
instance plan into g-GPU targets that every engine splits into the same rank planes."""

from __future__ import annotations

from typing import Any

from builders import pod

from kascade_operator import labels as L
from kascade_operator import scaleplan as SP
from kascade_operator.api import ModelServiceSpec
from kascade_operator.instruction import plan_tp
from kascade_operator.podtemplate import fallback_pod, refusals
from kascade_operator.pool import can_serve, pod_view
from kascade_operator.reconcile import CreatePlan
from kascade_operator.settings import OperatorSettings
from kascade_planner.tpgroup import rank_planes

NODES = [{"metadata": {"name": n, "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                            "kascade.io/scaleup-domain": n}},
          "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for n in ("n0", "n1", "n2")]


def spec(tp: int, **engine: Any) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"path": "/models/m"}},
                                            "engine": {"image": "img:1", "tp": tp, **engine},
                                            "replicas": {"colocated": {"min": 0, "max": 2}}})


def test_tp2_fallback_pod_runs_two_ranks_with_a_data_port_each_and_two_gpus() -> None:
    pool_res = {"limits": {"nvidia.com/gpu": 1, "memory": "48Gi"}}
    pod_ = fallback_pod(spec(2), "svc", "tok", None, default_resources=pool_res)
    c = pod_["spec"]["containers"][0]
    assert "--tp=2" in c["args"] and "--empty" in c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["data"] == 18515 and ports["data-r1"] == 18516  # rank 1's plane
    assert ports["act"] == 18517 and "--act-port=18517" in c["args"]  # moved past the rank ports
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 2, "memory": "48Gi"}
    assert pool_res["limits"]["nvidia.com/gpu"] == 1  # the installation's defaults are not changed
    assert pod_["metadata"]["annotations"][L.ENGINE_TP] == "2"
    one = fallback_pod(spec(1), "svc", "tok", None, default_resources=pool_res)
    c1 = one["spec"]["containers"][0]
    assert not any(a.startswith("--tp") for a in c1["args"]) and L.ENGINE_TP not in one["metadata"]["annotations"]
    assert {p["name"] for p in c1["ports"]} == {"http", "data", "act"}
    assert c1["resources"]["limits"]["nvidia.com/gpu"] == 1
    cpu = fallback_pod(spec(4), "svc", "tok", None, default_resources={"limits": {"memory": "4Gi"}})
    assert cpu["spec"]["containers"][0]["resources"] == {"limits": {"memory": "4Gi"}}  # a CPU pool asks no GPU


def test_only_pods_started_with_the_services_tp_are_bound() -> None:
    tp2 = fallback_pod(spec(2), "svc", "tok", None)
    view = pod_view({"metadata": {"name": "f", "labels": {L.POOL: L.POOL_WARM},
                                  "annotations": tp2["metadata"]["annotations"]}})
    assert view.tp == 2
    assert can_serve(view, "m", "svc", None, 2)
    assert not can_serve(view, "m", "svc", None, 1)
    pool = pod_view({"metadata": {"name": "p", "labels": {L.POOL: L.POOL_WARM}, "annotations": {L.MODEL: "m"}}})
    assert pool.tp == 1 and can_serve(pool, "m", "svc") and not can_serve(pool, "m", "svc", None, 2)
    bad = pod_view({"metadata": {"name": "b", "annotations": {L.ENGINE_TP: "two"}}})
    assert bad.tp == 1


def test_tp_pods_are_refused_where_their_planes_cannot_run_naming_the_field() -> None:
    tls = OperatorSettings(engine_image="img:1", allowed_host_path_roots=["/models"], engine_tls_secret="tls")
    assert any(r.startswith("spec.engine.tp: 2 ranks load their planes over plain TCP") for r in refusals(spec(2), tls))
    assert refusals(spec(1), tls) == []
    plain = OperatorSettings(engine_image="img:1", allowed_host_path_roots=["/models"])
    assert refusals(spec(2), plain) == []
    assert any(r.startswith("spec.engine.dataPort: 65535 + tp 2 - 1 exceeds 65535")
               for r in refusals(spec(2, dataPort=65535), plain))


def test_scaleplan_into_tp2_targets_is_an_instance_plan_every_engine_splits_alike() -> None:
    pods = {p.pod_name: p for p in (pod("s", "n0", "svc", "colocated", ready=True), pod("a", "n1"), pod("b", "n2"))}
    built = SP.build(CreatePlan("colocated", ("s",), ("a", "b"), "up"), pods, NODES,
                     SP.layout("m", 4), "chain", 2)
    plan = built.plan
    assert [(t.id, t.gpus) for t in plan.targets] == [("a", 2), ("b", 2)]
    assert not any(f.shard for f in plan.flows)  # the engines shard it, one plane per rank
    assert plan.predicted  # predicted as the sharded transfer it runs as
    doc = SP.spec_dict(built, "svc", "colocated", "up")
    assert plan_tp(doc["plan"]) == 2 and "shards" not in doc
    planes = rank_planes(plan, 2, "slices" if plan.sources[0].gpus == 2 else "parts",
                         {f"{b}@{r}/2": 1 for r in range(2) for b in plan.model.block_ids})
    assert [[(f.src, f.dst) for f in p.plan.flows] for p in planes] == [
        [("s.r0", "a.r0"), ("a.r0", "b.r0")], [("s.r1", "a.r1"), ("a.r1", "b.r1")]]
    one = SP.build(CreatePlan("colocated", ("s",), ("a",), "up"), pods, NODES,
                   SP.layout("m", 4), "chain", 1)
    assert plan_tp(one.plan.to_dict()) == 1


def test_tp_with_prefill_decode_disaggregation_is_accepted() -> None:
    """A TP instance's KV is gathered at / scattered from rank 0 (docs/tp.md): PD works with any tp."""
    from kascade_operator.validation import semantic_errors

    def pd(tp: int) -> ModelServiceSpec:
        return ModelServiceSpec.model_validate({
            "model": {"name": "m", "source": {"path": "/models/m"}}, "mode": "disaggregated",
            "engine": {"image": "img:1", "tp": tp},
            "replicas": {"prefill": {"min": 0, "max": 2}, "decode": {"min": 0, "max": 2}}})

    assert semantic_errors(pd(2), 8) == []
    assert semantic_errors(pd(1), 8) == []
    assert any(e.startswith("spec.engine.tp: 16 exceeds") for e in semantic_errors(pd(16), 8))
    assert semantic_errors(spec(2), 8) == []


def test_live_pairs_are_planned_for_services_of_any_tp() -> None:
    """A TP target loading by plan serves its resident prefix with a live pair (tests/engine/test_tp_live_load.py), so
    spec.scaling.live plans pairs at tp 2 as at tp 1; off is off."""
    from kascade_operator.plandriver import plans_live

    def live(tp: int, on: bool) -> ModelServiceSpec:
        return ModelServiceSpec.model_validate({**spec(tp).model_dump(by_alias=True, exclude_none=True),
                                                "scaling": {"live": on}})

    assert plans_live(live(1, True))
    assert plans_live(live(2, True))
    assert not plans_live(live(2, False))
    assert not plans_live(live(1, False))


def test_a_live_scaleplan_into_tp2_targets_pairs_them_with_no_execution_pipeline() -> None:
    """Live at tp 2: the loading target is paired with the serving source (it serves its resident prefix split), but
    no execution pipeline is planned (a TP engine as a pipeline hop is untested); at tp 1 binomial plans keep theirs."""
    pods = {p.pod_name: p for p in (pod("s", "n0", "svc", "colocated", ready=True), pod("a", "n1"), pod("b", "n2"))}
    act = CreatePlan("colocated", ("s",), ("a", "b"), "up")
    two = SP.build(act, pods, NODES, SP.layout("m", 4), "binomial", 2, live=True).plan
    assert two.live_pairs and {t for _, t in two.live_pairs} <= {"a", "b"}
    assert two.pipelines == ()
    one = SP.build(act, pods, NODES, SP.layout("m", 4), "binomial", 1, live=True).plan
    assert one.live_pairs and one.pipelines  # (λScale's receivers; livewiring forms those of two or more)
    assert SP.build(act, pods, NODES, SP.layout("m", 4), "binomial", 2, live=False).plan.live_pairs == ()
