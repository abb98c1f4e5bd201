"""Operator sharding on the real API server: two `kascade operator run` replicas with --shards 2 spread one shard
each, services of both shards get rounds (their pods bound), and when one replica is SIGKILLed the other takes its
shard over once its Lease expires and serves that shard's services (a scale-up there is bound)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from enginestub import EngineStub
from test_production_cluster import TOKEN, add_pool, apply, bound, kget, msvc

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for
from kascade_operator.sharding import shard_of

pytestmark = pytest.mark.cluster
LEASE_S = 6


@pytest.fixture
def second_namespace(control_plane: ControlPlane, namespace: str) -> Iterator[str]:
    """A namespace whose pool lands in the other shard of 2 than `namespace`'s."""
    name = next(f"{namespace}-b{i}" for i in range(100) if shard_of(f"{namespace}-b{i}", 2) != shard_of(namespace, 2))
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def stubs() -> Iterator[list[EngineStub]]:
    made: list[EngineStub] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def replicas(control_plane: ControlPlane, crds: list[str], namespace: str, second_namespace: str,
             tmp_path: Path) -> Iterator[Callable[[str], OperatorProcess]]:
    made: list[OperatorProcess] = []
    # renew deadline 5 s of a 6 s lease: a replica starved on the loaded 2-core CI machine must not give up its
    # shards mid-test (test_production_cluster's leader test measured the same)
    args = ("--namespace", second_namespace, "--leader-elect", "--shards", "2", "--lease-namespace", namespace,
            "--lease-duration", str(LEASE_S), "--lease-renew-deadline", "5", "--lease-retry", "1",
            "--engine-image", "kascade:dev", "--allowed-host-path-root", "/models")

    def make(identity: str) -> OperatorProcess:
        o = OperatorProcess(control_plane, namespace, TOKEN, tmp_path / f"{identity}.log",
                            extra_args=(*args, "--identity", identity))
        made.append(o)
        return o.start(wait=False)

    yield make
    for o in made:
        o.stop()
        print(o.tail(4000))


def holders(cp: ControlPlane, ns: str) -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for lease in kget(cp, ns, "leases", "-l", "kascade.io/lease-role=shard")["items"]:
        out[int(lease["metadata"]["labels"]["kascade.io/shard"])] = lease["spec"].get("holderIdentity")
    return out


def test_two_replicas_hold_a_shard_each_and_one_takes_over_when_the_other_dies(
        control_plane: ControlPlane, namespace: str, second_namespace: str,
        replicas: Callable[[str], OperatorProcess], stubs: list[EngineStub],
        kwok_nodes: Callable[..., list[str]]) -> None:
    cp, ns1, ns2 = control_plane, namespace, second_namespace
    nodes = kwok_nodes(4)
    add_pool(cp, ns1, stubs, nodes, 2)
    add_pool(cp, ns2, stubs, nodes, 3)
    ops = {"a": replicas("a"), "b": replicas("b")}
    # a may take both shards before b's member Lease shows (it is alone then); it gives one back once b is live
    def one_each() -> dict[int, str | None] | None:
        h = holders(cp, ns1)
        return h if sorted(map(str, h.values())) == ["a", "b"] else None

    spread = wait_for(one_each, timeout=90, what="one shard per replica")
    apply(cp, ns1, msvc("svc", 1, 2))
    apply(cp, ns2, msvc("svc", 1, 3))
    # (each replica's kopf sees both services: before shardhooks.claims, the two racing to add the finalizer left
    # the owner's kopf stalled and this timed out)
    wait_for(lambda: len(bound(cp, ns1, "svc")) == 1 and len(bound(cp, ns2, "svc")) == 1, timeout=60,
             what="both shards' services bound")
    assert spread is not None and holders(cp, ns1) == spread  # nobody gave up or stole a shard while both served
    owner2 = str(spread[shard_of(ns2, 2)])
    other = "b" if owner2 == "a" else "a"
    # each service's rounds ran in its shard's holder only (the actuator logs each decision at INFO under -v)
    logs = {k: o.tail(500_000) for k, o in ops.items()}
    assert f"{ns2}/svc decision" in logs[owner2] and f"{ns2}/svc decision" not in logs[other]
    assert f"{ns1}/svc decision" in logs[other] and f"{ns1}/svc decision" not in logs[owner2]

    ops[owner2].kill()  # SIGKILL: its Leases are not released, they expire
    t_kill = time.monotonic()
    wait_for(lambda: holders(cp, ns1).get(shard_of(ns2, 2)) == other, timeout=60, what="the survivor takes the shard")
    took = time.monotonic() - t_kill
    # the dead replica's last renewal was up to one retry period (1 s) before the kill; the survivor sees the record
    # stop changing at its next tick (<= 1 s) and takes the shard a lease duration (6 s) later: ~6-8 s. Slack: the
    # survivor's tick (a LIST and two writes) and kubectl's polling on a loaded shared 2-core machine, 5 s.
    assert took < LEASE_S + 2 * 1 + 5, f"took over {took:.1f} s after the kill (lease {LEASE_S} s)"
    apply(cp, ns2, msvc("svc", 2, 3))  # the taken-over shard's service scales up: served by the survivor
    wait_for(lambda: len(bound(cp, ns2, "svc")) == 2, timeout=60, what="the survivor scales the taken-over service")
    apply(cp, ns1, msvc("svc", 2, 2))  # and the survivor's own shard still runs
    wait_for(lambda: len(bound(cp, ns1, "svc")) == 2, timeout=60, what="the survivor's own service scales")
    print(f"shard taken over {took:.2f} s after SIGKILL of its holder (lease {LEASE_S} s, retry 1 s)")
