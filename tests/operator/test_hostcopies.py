"""Host copies in the operator's pure core (issue 18 item 5): from zero the first replica binds from an idle
pod's host copy (one target; the rest chain from it next round), a ScalePlan says `hostCopy` for that source,
other models' copies are bound last, status.sources lists host copies, pod views read the annotation."""

from __future__ import annotations

import dataclasses

from builders import pod, spec

from kascade_operator import labels as L
from kascade_operator import scaleplan as SP
from kascade_operator.hostcopykeeper import keeper, surplus
from kascade_operator.pool import bind_patch, choose_targets, keep_host_copy, pod_view, unbind_patch
from kascade_operator.reconcile import CreatePlan, reconcile
from kascade_operator.status import service_status


def hc(name: str, model: str = "m", **kw: object) -> object:
    return dataclasses.replace(pod(name, **kw), host_copy=model)


def test_from_zero_the_first_replica_binds_from_a_host_copy_alone() -> None:
    pods = [pod("p-a", "n1"), hc("p-b", node="n2"), hc("p-c", node="n3")]
    res = reconcile("svc", spec(lo=0, hi=4), pods, [], {"colocated": 3}, "router demand")
    assert res.actions == (CreatePlan("colocated", (), ("p-b",), "router demand; first copy from the host copy on p-b",
                                      host_copy=True),)
    # another model's copy is no source here; with no copy of ours it is the old path (spec.model.source)
    res = reconcile("svc", spec(lo=0, hi=4), [pod("p-a", "n1"), hc("p-x", "other", node="n2")], [], {"colocated": 1},
                    "router demand")
    assert res.actions == (CreatePlan("colocated", (), ("p-a",), "router demand"),)


def test_with_a_serving_copy_the_host_copy_is_a_source_not_a_target() -> None:
    ready = pod("s", "n0", "svc", "colocated", ready=True)
    pods = [ready, hc("p-a", node="n1"), pod("p-b", "n2"), pod("p-c", "n3"), hc("p-x", "other", node="n3")]
    res = reconcile("svc", spec(lo=1, hi=4), pods, [], {"colocated": 3}, "up")
    # the copy of our model sends (and stays released); another model's copy is neither source nor target
    assert res.actions == (CreatePlan("colocated", ("s", "p-a"), ("p-b", "p-c"), "up"),)
    # more targets than plain idle pods: a copy bound as a target is no source of the same plan
    res = reconcile("svc", spec(lo=1, hi=4), pods[:3], [], {"colocated": 3}, "up")
    assert res.actions == (CreatePlan("colocated", ("s",), ("p-b", "p-a"), "up"),)
    # a plan in flight holds its host source (handlers pass such pods as unavailable): not offered again
    res = reconcile("svc", spec(lo=1, hi=4), pods[:3], [], {"colocated": 2}, "up", unavailable={"p-a"})
    assert res.actions == (CreatePlan("colocated", ("s",), ("p-b",), "up"),)


NODES = [{"metadata": {"name": n, "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                            "kascade.io/scaleup-domain": n}},
          "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for n in ("n0", "n1", "n2", "n3")]


def test_scaleplan_lists_the_host_copy_as_a_host_source_next_to_the_gpu_source() -> None:
    pods = {p.pod_name: p for p in (pod("s", "n0", "svc", "colocated", ready=True), hc("p-a", node="n1"),
                                     pod("p-b", "n2"), pod("p-c", "n3"))}
    action = CreatePlan("colocated", ("s", "p-a"), ("p-b", "p-c"), "up")
    built = SP.build(action, pods, NODES, SP.layout("m", 4), "chain", 1, live=True)  # type: ignore[arg-type]
    assert [(s.id, s.kind) for s in built.plan.sources] == [("p-a", "host"), ("s", "gpu")]
    assert sorted(c[0] for c in built.plan.chains) == ["p-a", "s"]  # one chain from each: the copy sends
    assert {f.src for f in built.plan.flows} >= {"p-a"}
    assert all(a == "s" for a, _ in built.plan.live_pairs)  # a host copy serves nothing: never live-paired
    d = SP.spec_dict(built, "svc", "colocated", "up", "/models/m")
    assert d["sources"] == [{"instance": "p-a", "node": "n1", "kind": "host", "pod": "p-a", "hostCopy": True},
                            {"instance": "s", "node": "n0", "kind": "gpu", "pod": "s"}]
    assert [t["pod"] for t in d["targets"]] == ["p-b", "p-c"]  # the copy's pod is never a target (never bound)
    # one target domain: one chain, from the GPU source on a tie (a host copy sends at min(NIC, PCIe): here the
    # NIC, as the GPU does; kascade_planner.chains.source_gbps); the copy is the fallback
    one = SP.build(CreatePlan("colocated", ("s", "p-a"), ("p-b",), "up"), pods, NODES,  # type: ignore[arg-type]
                   SP.layout("m", 4), "chain", 1)
    assert one.plan.chains == (("s", "p-b"),) and one.plan.fallbacks == (("p-b", ("s", "p-a")),)


def test_choose_targets_orders_host_copies() -> None:
    idle = [hc("a", "other", node="n1"), pod("b", "n2"), hc("c", node="n3")]
    assert [p.pod_name for p in choose_targets(idle, 3, ())] == ["b", "a", "c"]  # binding drops a copy: copies last


def test_pod_view_reads_the_annotation_and_bind_clears_it() -> None:
    raw = {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "7", "labels": {L.POOL: L.POOL_WARM},
                        "annotations": {L.HOST_COPY: "m", L.ENDPOINT: "10.0.0.1:8000"}},
           "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    p = pod_view(raw)
    assert p.host_copy == "m"
    patch = bind_patch(p, "svc", "colocated", "plan-1")
    assert patch["metadata"]["annotations"][L.HOST_COPY] is None  # bound from elsewhere: no host copy recorded
    kept = bind_patch(p, "svc", "colocated", "plan-1", host_copy="m")  # bound from its copy, which it still keeps
    assert kept["metadata"]["annotations"][L.HOST_COPY] == "m"
    assert pod_view({**raw, "metadata": {**raw["metadata"], "annotations": {L.HOST_COPY_REFUSED: "m"}}}
                    ).host_copy_refused == "m"
    bound = dataclasses.replace(p, model_service="svc", host_copy=None)
    assert unbind_patch(bound, host_copy="m")["metadata"]["annotations"][L.HOST_COPY] == "m"  # kept at release
    assert unbind_patch(bound)["metadata"]["annotations"][L.HOST_COPY] is None


def test_scaleplan_names_the_host_copy_source() -> None:
    action = CreatePlan("colocated", (), ("p-b",), "from zero", host_copy=True)
    pods = {"p-b": hc("p-b", node="n2")}
    nodes = [{"metadata": {"name": n, "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                                           "kascade.io/scaleup-domain": n}},
              "status": {"allocatable": {"nvidia.com/gpu": "8"}}} for n in ("n1", "n2")]
    built = SP.build(action, pods, nodes, SP.layout("m", 4), "chain", 1)  # type: ignore[arg-type]
    d = SP.spec_dict(built, "svc", "colocated", "from zero", "/models/m")
    assert d["algorithm"] == "local"
    assert d["sources"] == [{"instance": "host:n2", "node": "n2", "kind": "host", "hostCopy": True}]
    plain = SP.spec_dict(SP.build(dataclasses.replace(action, host_copy=False), pods, nodes,  # type: ignore[arg-type]
                                  SP.layout("m", 4), "chain", 1), "svc", "colocated", "x", "/models/m")
    assert plain["sources"] == [{"instance": "ssd:n2", "node": "n2", "kind": "host", "path": "/models/m"}]


def test_status_sources_list_host_copies_of_the_model() -> None:
    pods = [pod("s", "n0", "svc", "colocated", ready=True), hc("h1", node="n1"), hc("h2", "other", node="n2"),
            dataclasses.replace(hc("h3", node="n3"), created_for="another")]
    res = reconcile("svc", spec(lo=1, hi=2), pods, [], None)
    st = service_status("svc", "svc", res, pods, [], 1, model="m")
    assert st["sources"] == [{"kind": "gpu", "location": "s", "node": "n0"},
                             {"kind": "host", "location": "h1", "node": "n1"}]


def test_a_release_keeps_a_copy_only_while_the_pool_holds_fewer_than_the_setting() -> None:
    pods = [pod("r", "n0", "svc", "colocated"), hc("h1", node="n1"), hc("x", "other", node="n2")]
    assert keep_host_copy(pods, "m", "r", 1) is False  # h1 already keeps m
    assert keep_host_copy(pods, "m", "r", 2) is None  # room for a second copy: the engine keeps one if it fits
    assert keep_host_copy(pods, "other", "r", 2) is None
    assert keep_host_copy([pods[0]], "m", "r", 1) is None  # the first copy of m
    assert keep_host_copy([pods[0]], "m", "r", 0) is False  # 0: none kept
    assert keep_host_copy([hc("r")], "m", "r", 1) is None  # its own (stale) annotation does not count


def test_a_plan_in_flight_holds_its_host_copy_source() -> None:
    from kascade_operator.handlers import held_pods
    sp = {"spec": {"targets": [{"instance": "p-b", "pod": "p-b"}],
                   "sources": [{"instance": "s", "pod": "s", "kind": "gpu"},
                               {"instance": "p-a", "pod": "p-a", "kind": "host", "hostCopy": True},
                               {"instance": "host:n2", "node": "n2", "kind": "host", "hostCopy": True}]}}
    assert [t["pod"] for t in held_pods(sp)] == ["p-b", "p-a"]  # bound sources are held by their binding


def test_status_sources_list_a_serving_pods_host_copy_as_host_too() -> None:
    """A replica bound from its host copy keeps it while it serves: it is a gpu source and a host one."""
    pods = [dataclasses.replace(pod("s", "n0", "svc", "colocated", ready=True), host_copy="m"),
            dataclasses.replace(pod("o", "n1", "other-svc", "colocated", ready=True), host_copy="m")]
    res = reconcile("svc", spec(lo=1, hi=2), pods, [], None)
    st = service_status("svc", "svc", res, pods, [], 1, model="m")
    assert st["sources"] == [{"kind": "gpu", "location": "s", "node": "n0"},
                             {"kind": "host", "location": "s", "node": "n0"}]


def test_a_serving_copy_gives_way_to_a_released_one() -> None:
    """A serving replica's copy (the keeper's stopgap, or the one it bound from) does not stop a release from
    keeping one (issue 40: whether it existed depended on the rounds' timing); once released pods keep
    host_copies_per_model copies, the service's serving copies are surplus and dropped."""
    serving = dataclasses.replace(pod("s", "n0", "svc", "colocated", ready=True), host_copy="m")
    other = pod("r", "n1", "svc", "colocated")
    assert keep_host_copy([serving, other], "m", "r", 1) is None  # r keeps the copy at its release
    assert keep_host_copy([serving, other], "m", "s", 1) is None  # s itself keeps it at its release
    released = dataclasses.replace(other, model_service=None, role=None, host_copy="m")
    assert keep_host_copy([serving, released], "m", "s", 1) is False  # a released copy exists: s drops its own
    assert surplus([serving, other], "m", "svc", 1) == []  # no released copy yet: s keeps the only one
    assert surplus([serving, released], "m", "svc", 1) == [serving]
    assert surplus([serving, released], "m", "svc", 2) == []  # room for two: both stay
    assert surplus([serving, released], "m", "other-svc", 1) == []  # each service drops its own
    assert surplus([serving, dataclasses.replace(released, unhealthy="dead")], "m", "svc", 1) == []
    assert surplus([serving, released], "m", "svc", 0) == []


def test_the_keeper_is_one_ready_serving_pod_and_only_while_no_copy_exists() -> None:
    ready = [pod(n, f"n{i}", "svc", "colocated", ready=True) for i, n in enumerate(("e2", "e0", "e1"))]
    assert keeper(ready, "m", "svc", 1).pod_name == "e0"  # type: ignore[union-attr]  # the oldest: drained last
    assert keeper(ready, "m", "svc", 0) is None  # hostCopiesPerModel 0: none kept
    assert keeper([*ready, hc("h", node="n5")], "m", "svc", 1) is None  # a released copy exists
    assert keeper([*ready, hc("h", "other", node="n5")], "m", "svc", 1).pod_name == "e0"  # type: ignore[union-attr]
    assert keeper([*ready, dataclasses.replace(hc("h", node="n5"), unhealthy="dead")], "m", "svc", 1) is not None
    refused = [dataclasses.replace(ready[1], host_copy_refused="m"), ready[0], ready[2]]
    assert keeper(refused, "m", "svc", 1).pod_name == "e1"  # type: ignore[union-attr]
    draining = [dataclasses.replace(p, draining=True) for p in ready]
    assert keeper(draining, "m", "svc", 1) is None
    assert keeper([pod("l", "n0", "svc", "colocated")], "m", "svc", 1) is None  # loading: nothing to keep yet
    assert keeper(ready, "m", "another-svc", 1) is None
    # a release in flight keeps a copy (issue 40): asked now, a replica that stays kept it and the release dropped
    in_flight = [*ready, pod("d", "n3", "svc", "colocated", ready=True, draining=True)]
    assert keeper(in_flight, "m", "svc", 1) is None
    assert keeper(in_flight, "m", "other-svc", 1) is None  # another service's: nothing of ours to ask anyway
    refusing = [*ready, dataclasses.replace(in_flight[-1], host_copy_refused="m")]  # its budget: it keeps none
    assert keeper(refusing, "m", "svc", 1).pod_name == "e0"  # type: ignore[union-attr]
    dead = [*ready, dataclasses.replace(in_flight[-1], unhealthy="unreachable")]  # released without its engine
    assert keeper(dead, "m", "svc", 1).pod_name == "e0"  # type: ignore[union-attr]


def test_with_a_node_cache_copies_are_counted_per_node() -> None:
    """pool.nodeCache (settings.node_cache): the engines of a node map its one copy (ADR 16), so
    hostCopiesPerModel counts nodes: a release on a node whose copy is counted keeps it (no more bytes), a release
    on another node beyond the budget drops its weights; without the node cache every engine's copy counts."""
    a = dataclasses.replace(pod("a", "n1"), host_copy="m")  # released, keeps m on n1
    b = pod("b", "n1", "svc", "colocated", ready=True)  # serving on n1
    c = pod("c", "n2", "svc", "colocated", ready=True)  # serving on n2
    assert keep_host_copy([a, b, c], "m", "b", 1, node_cache=True) is None  # n1's copy: b keeps it too
    assert keep_host_copy([a, b, c], "m", "c", 1, node_cache=True) is False  # n2 would be a second copy
    assert keep_host_copy([a, b, c], "m", "b", 1) is False  # private copies: b's would be a second one
    assert keep_host_copy([a, b, c], "m", "c", 2, node_cache=True) is None  # room for two nodes
    # two released pods of one node are one copy: a serving copy on n2 is not surplus under a budget of 2 nodes
    a2 = dataclasses.replace(pod("a2", "n1"), host_copy="m")
    served = dataclasses.replace(c, host_copy="m")
    assert surplus([a, a2, served], "m", "svc", 2, node_cache=True) == []
    assert surplus([a, a2, served], "m", "svc", 2) == [served]  # without: two released copies already
    # a fallback pod (created for one service) has no node cache: its copy is its own even with node_cache
    fb = dataclasses.replace(pod("f", "n1"), host_copy="m", created_for="svc")
    assert keep_host_copy([fb, b], "m", "b", 1, node_cache=True) is False
