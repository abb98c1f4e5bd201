"""BlitzScale's PD-aware planning in the operator: a disaggregated scale-up may load from either role's
ready pods (same model), and the plan carries the live prefill -> decode KV flows so the planner prunes
sources whose egress carries KV: a new prefill instance loads from a decode instance."""

from __future__ import annotations

import dataclasses

from builders import pod, spec

from kascade_operator.reconcile import CreatePlan, reconcile
from kascade_operator.scaleplan import build, layout

NODES = [{"metadata": {"name": n, "labels": {"kascade.io/leaf": "l", "kascade.io/nic-gbps": "100",
                                             "kascade.io/scaleup-domain": n}},
          "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for n in ("n0", "n1", "n2", "n3")]


def _pods() -> list:
    return [
        pod("pre", "n0", ms="svc", role="prefill", ready=True),
        pod("dec", "n1", ms="svc", role="decode", ready=True),
        pod("idle-a", "n2"),
        pod("idle-b", "n3"),
    ]


def test_prefill_scale_up_loads_from_the_decode_instance() -> None:
    pods = _pods()
    res = reconcile("svc", spec("disaggregated", lo=1, hi=4), pods, [], {"prefill": 2})
    plans = [a for a in res.actions if isinstance(a, CreatePlan)]
    assert len(plans) == 1 and plans[0].role == "prefill"
    act = plans[0]
    assert act.sources == ("dec", "pre") and act.kv_flows == (("pre", "dec"),)
    by_name = {p.pod_name: p for p in pods}
    built = build(act, by_name, NODES, layout("m", 4), "chain", 1)
    assert built.plan.chains == (("dec", "idle-a"),)  # the prefiller's egress carries KV: pruned
    assert {f.src for f in built.plan.flows} == {"dec"}
    assert "pruned source pre: its egress carries a KV flow" in built.plan.notes


def test_kv_flows_are_dropped_when_every_source_carries_kv() -> None:
    pods = [pod("pre", "n0", ms="svc", role="prefill", ready=True), pod("dec", "n1", ms="svc", role="decode"),
            pod("idle-a", "n2")]
    act = CreatePlan("prefill", ("pre",), ("idle-a",), "x", (("pre", "dec"),))
    built = build(act, {p.pod_name: p for p in pods}, NODES, layout("m", 4), "chain", 1)
    assert built.plan.chains == (("pre", "idle-a"),)  # the only copy still sends weights
    assert not any("pruned" in n for n in built.plan.notes)


def test_colocated_sources_are_unchanged() -> None:
    pods = [pod("s", "n0", ms="svc", role="colocated", ready=True), pod("idle-a", "n2")]
    res = reconcile("svc", spec(lo=1, hi=4), pods, [], {"colocated": 2})
    assert res.actions == (CreatePlan("colocated", ("s",), ("idle-a",), "colocated: 1 -> 2 replicas"),)


def test_a_host_copy_is_kept_while_kv_carrying_prefillers_are_pruned() -> None:
    # an idle pod keeps the model in host memory: it serves nothing and carries no KV
    pods = [
        pod("pre", "n0", ms="svc", role="prefill", ready=True),
        pod("dec", "n1", ms="svc", role="decode", ready=True),
        dataclasses.replace(pod("hc", "n3"), host_copy="m"),
        pod("idle-a", "n2"),
        pod("idle-b", "n3"),
    ]
    res = reconcile("svc", spec("disaggregated", lo=1, hi=4), pods, [], {"prefill": 3})
    act = next(a for a in res.actions if isinstance(a, CreatePlan))
    assert act.role == "prefill" and act.targets == ("idle-a", "idle-b")
    assert act.sources == ("dec", "pre", "hc") and act.kv_flows == (("pre", "dec"),)
    built = build(act, {p.pod_name: p for p in pods}, NODES, layout("m", 4), "chain", 1)
    assert {(s.id, s.kind) for s in built.plan.sources} == {("pre", "gpu"), ("dec", "gpu"), ("hc", "host")}
    assert "pruned source pre: its egress carries a KV flow" in built.plan.notes
    assert not any("hc" in n for n in built.plan.notes)  # never pruned
    assert sorted(c[0] for c in built.plan.chains) == ["dec", "hc"]  # one chain each; none from the prefiller
    # the prefiller alone (the decoder not ready yet): before, its KV flow was ignored so it still sent
    # weights; with a host copy the flow stands and the copy sends
    only = CreatePlan("prefill", ("pre", "hc"), ("idle-a",), "x", (("pre", "dec"),))
    built = build(only, {p.pod_name: p for p in pods}, NODES, layout("m", 4), "chain", 1)
    assert built.plan.chains == (("hc", "idle-a"),)


def test_a_new_decode_instance_loads_from_a_prefill_instance() -> None:
    # and vice versa: no decoder serves yet, so the prefiller's egress carries no KV and it is the chain's source
    pods = [pod("pre", "n0", ms="svc", role="prefill", ready=True), pod("idle-a", "n2")]
    res = reconcile("svc", spec("disaggregated", lo=1, hi=4), pods, [], {"prefill": 1, "decode": 1})
    act = next(a for a in res.actions if isinstance(a, CreatePlan))
    assert act.role == "decode" and act.sources == ("pre",) and act.targets == ("idle-a",) and act.kv_flows == ()
    built = build(act, {p.pod_name: p for p in pods}, NODES, layout("m", 4), "chain", 1)
    assert built.plan.chains == (("pre", "idle-a"),) and not any("pruned" in n for n in built.plan.notes)
