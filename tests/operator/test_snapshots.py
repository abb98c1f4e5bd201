"""snapshots.py: the pool and plans grouped once per index change, and what one round selects from them."""

from __future__ import annotations

import dataclasses
from typing import Any

from builders import pod

from kascade_operator.snapshots import cached, group_plans, group_pool


def raw(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}}


def test_a_round_selects_its_own_pods_the_idle_ones_and_its_models_copies_in_pool_order() -> None:
    views = [pod("a0", ms="a", role="colocated", ready=True), pod("b0", ms="b", role="colocated", ready=True),
             pod("i0"), dataclasses.replace(pod("b1", ms="b", role="colocated"), host_copy="m"),
             pod("a1", ms="a", role="colocated", draining=True), None]
    snap = group_pool([raw(f"r{i}") for i in range(6)], views)
    pods, raws = snap.select("a", "m")
    assert [p.pod_name for p in pods] == ["a0", "i0", "b1", "a1"]
    assert [r["metadata"]["name"] for r in raws] == ["r0", "r2", "r3", "r4", "r5"]  # r5: being deleted (no view)
    assert pods[3].drained  # a draining pod's release is tried every round
    assert [p.pod_name for p in snap.select("a", "other")[0]] == ["a0", "i0", "a1"]


def test_unfinished_plans_hold_their_targets_and_host_sources() -> None:
    plans = [{"metadata": {"name": "p1"}, "spec": {"modelServiceRef": {"name": "a"}, "targets": [{"pod": "x"}],
                                                   "sources": [{"pod": "h", "hostCopy": True}, {"pod": "g"}]}},
             {"metadata": {"name": "p2"}, "spec": {"modelServiceRef": {"name": "b"}, "targets": [{"pod": "y"}]},
              "status": {"phase": "Succeeded"}}]
    snap = group_plans(plans)
    assert snap.held == frozenset({"x", "h"})
    assert [p["metadata"]["name"] for p in snap.of("b")] == ["p2"] and snap.of("c") == ()


def test_the_cache_rebuilds_exactly_when_an_object_is_replaced() -> None:
    cache: dict[Any, Any] = {}
    objs = [raw("a"), raw("b")]
    builds = []

    def build() -> int:
        builds.append(1)
        return len(builds)

    assert cached(cache, "k", list(objs), None, build) == 1
    assert cached(cache, "k", list(objs), None, build) == 1  # a new list of the same objects: cached
    objs[1] = raw("b")  # the watch stored a new version of b
    assert cached(cache, "k", list(objs), None, build) == 2
    assert cached(cache, "k", objs[:1], None, build) == 3  # b deleted
