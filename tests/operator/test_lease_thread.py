"""Leader election on the real API server, with the operator's event loop blocked (kopf filling its indexes at
fleet scale, a long synchronous step): the Lease is renewed from the election's own thread, so a busy leader keeps
leading; and a leader that loses its Lease while its loop is blocked is fenced (the process ends) before a standby
may start."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_operator.kube import Kube
from kascade_operator.leader import LeadershipLost, lead_then_run
from kascade_operator.settings import OperatorSettings

pytestmark = pytest.mark.cluster

LEASE = "kascade-thread"
BLOCKED_S = 7.0  # more than twice the lease below


def _settings(me: str, ns: str, shards: int = 1) -> OperatorSettings:
    """A 3 s lease, 2 s renew deadline, 1 s retry."""
    return OperatorSettings(identity=me, lease_namespace=ns, shards=shards, leader_election=True, lease_name=LEASE,
                            lease_duration_seconds=3, lease_renew_deadline_seconds=2, lease_retry_seconds=1)


def _holder(kc: str, ns: str) -> str | None:
    async def read() -> str | None:
        from kubernetes_asyncio import client

        kube = await Kube.connect(kc)
        try:
            lease = await client.CoordinationV1Api(kube.api).read_namespaced_lease(LEASE, ns)
            return lease.spec.holder_identity
        finally:
            await kube.close()

    return asyncio.run(read())


def _in_thread(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> tuple[threading.Thread, list[BaseException]]:
    """Run `coro_fn()` in its own thread and event loop (a replica); what it raises is collected."""
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(coro_fn())
        except BaseException as e:  # reported to the test
            errors.append(e)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t, errors


def test_a_leader_whose_loop_is_blocked_keeps_its_lease(control_plane: ControlPlane, namespace: str) -> None:
    kc = str(control_plane.kubeconfig)
    a = _settings("op-a", namespace)
    b = _settings("op-b", namespace)
    a_leads, a_unblocked, a_stop, b_leads = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    async def run_a() -> None:
        a_leads.set()
        await asyncio.sleep(1.5)  # b is waiting by now
        time.sleep(BLOCKED_S)  # the operator's loop does nothing else meanwhile
        a_unblocked.set()
        while not a_stop.is_set():
            await asyncio.sleep(0.05)

    async def run_b() -> None:
        b_leads.set()

    ta, a_errors = _in_thread(lambda: lead_then_run(a, run_a, kubeconfig=kc))
    assert a_leads.wait(30), "a never led"
    tb, b_errors = _in_thread(lambda: lead_then_run(b, run_b, kubeconfig=kc))
    assert a_unblocked.wait(30)
    # with the election in the operator's loop, no renewal ran for 7 s: b led after ~3 s and a lost its Lease
    assert not b_leads.is_set(), "the standby led while the leader's loop was blocked"
    assert not a_errors, a_errors
    assert _holder(kc, namespace) == "op-a"
    a_stop.set()  # a clean stop hands over at once
    ta.join(15)
    assert not ta.is_alive() and not a_errors, a_errors
    assert b_leads.wait(15), "the standby did not lead after the leader stopped"
    tb.join(15)
    assert not b_errors, b_errors


def test_a_leader_losing_its_lease_while_its_loop_is_blocked_is_fenced(control_plane: ControlPlane,
                                                                       namespace: str) -> None:
    kc = str(control_plane.kubeconfig)
    a = _settings("op-a", namespace)
    a_leads, a_unblocked = threading.Event(), threading.Event()
    fenced: list[tuple[int, float]] = []
    block: list[float] = []

    async def run_a() -> None:
        a_leads.set()
        t0 = time.monotonic()
        block.append(t0)
        time.sleep(BLOCKED_S)  # blocked while its Lease is taken
        block.append(time.monotonic())
        a_unblocked.set()
        await asyncio.sleep(30)  # cancelled once the loop sees the loss

    ta, a_errors = _in_thread(lambda: lead_then_run(a, run_a, kubeconfig=kc,
                                                    fence=lambda code: fenced.append((code, time.monotonic()))))
    assert a_leads.wait(30), "a never led"
    time.sleep(0.5)
    # another holder takes the Lease (as a standby would after an expiry this replica never saw)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    control_plane.kubectl("-n", namespace, "patch", "lease", LEASE, "--type", "merge", "-p",
                          f'{{"spec": {{"holderIdentity": "op-x", "renewTime": "{now}", "leaseDurationSeconds": 30}}}}')
    assert a_unblocked.wait(30)
    ta.join(15)
    assert not ta.is_alive()
    assert fenced, "the leader's loop was blocked past the renew deadline and nothing fenced it"
    code, at = fenced[0]
    assert code == 3 and block[0] < at < block[1], (fenced, block)
    # once its loop runs again, the leader stops acting and says why
    assert len(a_errors) == 1 and isinstance(a_errors[0], LeadershipLost), a_errors
    assert "could not renew" in str(a_errors[0])


def test_a_shard_holder_whose_loop_is_blocked_keeps_its_shards(control_plane: ControlPlane, namespace: str) -> None:
    from kascade_operator.shardlead import lead_shards_then_run
    from kascade_operator.shardset import ShardSet

    kc = str(control_plane.kubeconfig)
    a = _settings("op-a", namespace, shards=2)
    b = _settings("op-b", namespace, shards=2)
    a_set, b_set = ShardSet(2), ShardSet(2)
    a_unblocked, stop = threading.Event(), threading.Event()
    b_held_while_blocked: list[set[int]] = []

    async def run_a() -> None:
        while len(a_set.held) < 2:  # alone: it takes both
            await asyncio.sleep(0.05)
        time.sleep(BLOCKED_S)  # b starts meanwhile; a's loop does nothing else
        b_held_while_blocked.append(set(b_set.held))
        a_unblocked.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)

    async def run_b() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)

    ta, a_errors = _in_thread(lambda: lead_shards_then_run(a, a_set, run_a, kubeconfig=kc))
    deadline = time.monotonic() + 30
    while len(a_set.held) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a_set.held == {0, 1}, a_set.held
    tb, b_errors = _in_thread(lambda: lead_shards_then_run(b, b_set, run_b, kubeconfig=kc))
    assert a_unblocked.wait(30)
    # with the campaign in kopf's loop, a renewed nothing for 7 s: b took both shards while a still acted on them
    assert b_held_while_blocked == [set()], b_held_while_blocked
    # once a's loop runs again it gives one shard back (fair share 1 of 2) and b takes it
    deadline = time.monotonic() + 30
    while not (len(a_set.held) == 1 and len(b_set.held) == 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(a_set.held) == 1 and a_set.held.isdisjoint(b_set.held) and len(b_set.held) == 1, (a_set.held,
                                                                                                  b_set.held)
    assert not a_errors and not b_errors, (a_errors, b_errors)
    stop.set()
    ta.join(20)
    tb.join(20)
    assert not a_errors and not b_errors, (a_errors, b_errors)
