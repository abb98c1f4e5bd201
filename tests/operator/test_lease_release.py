"""Leader election on the real API server: a leader that stops cleanly releases its Lease, so a standby
leads within its retry period rather than after the lease duration (a rolling update of the operator
then pauses scaling for ~a second, not 15 s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_operator.kube import Kube
from kascade_operator.leader import lead_then_run, release_lease
from kascade_operator.settings import OperatorSettings

pytestmark = pytest.mark.cluster


def test_clean_stop_releases_the_lease_and_the_standby_leads_at_once(control_plane: ControlPlane,
                                                                      namespace: str) -> None:
    kc = str(control_plane.kubeconfig)
    # lease 30 s: without the release the standby could not lead for 30 s after the leader's last renewal
    common = dict(leader_election=True, lease_namespace=namespace, lease_name="kascade-test",
                  lease_duration_seconds=30, lease_renew_deadline_seconds=20, lease_retry_seconds=1)
    a, b = OperatorSettings(identity="op-a", **common), OperatorSettings(identity="op-b", **common)

    async def holder() -> str | None:
        kube = await Kube.connect(kc)
        try:
            from kubernetes_asyncio import client
            lease = await client.CoordinationV1Api(kube.api).read_namespaced_lease("kascade-test", namespace)
            return lease.spec.holder_identity
        finally:
            await kube.close()

    async def run() -> float:
        a_leads, b_leads = asyncio.Event(), asyncio.Event()
        a_stop = asyncio.Event()

        async def run_a() -> None:
            a_leads.set()
            await a_stop.wait()  # "kopf" until SIGTERM

        async def run_b() -> None:
            b_leads.set()

        ta = asyncio.create_task(lead_then_run(a, run_a, kubeconfig=kc))
        await asyncio.wait_for(a_leads.wait(), 30)
        assert await holder() == "op-a"
        tb = asyncio.create_task(lead_then_run(b, run_b, kubeconfig=kc))
        await asyncio.sleep(2.5)  # b retries every second and must not lead while a holds the Lease
        assert not b_leads.is_set()
        t0 = time.monotonic()
        a_stop.set()  # a clean stop
        await asyncio.wait_for(ta, 10)
        await asyncio.wait_for(b_leads.wait(), 15)
        took = time.monotonic() - t0
        await asyncio.wait_for(tb, 15)
        # b's run() returned, so b released too; releasing a Lease one does not hold changes nothing
        assert await holder() is None
        kube = await Kube.connect(kc)
        try:
            assert await release_lease(kube, "kascade-test", namespace, "op-a") is False
        finally:
            await kube.close()
        return took

    took = asyncio.run(run())
    assert took < 10, f"the standby led {took:.1f} s after the leader stopped (lease duration 30 s)"
    print(f"standby led {took:.2f} s after a clean stop of the leader (lease duration 30 s)")
