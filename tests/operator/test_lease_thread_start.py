"""A Lease thread that cannot even start (no kubeconfig, no in-cluster config) ends the replica with the reason:
it died alone before, and the operator's loop waited forever (a standby that never led, or a sharded replica
that never held a shard). No cluster needed: nothing is reached."""

from __future__ import annotations

import asyncio

import pytest

from kascade_operator.leader import LeadershipLost, lead_then_run
from kascade_operator.settings import OperatorSettings
from kascade_operator.shardlead import lead_shards_then_run
from kascade_operator.shardset import ShardSet

NOWHERE = "/nonexistent/kubeconfig"


def _settings(shards: int) -> OperatorSettings:
    return OperatorSettings(identity="a", lease_namespace="default", shards=shards, leader_election=True,
                            lease_name="kascade-start", lease_duration_seconds=3, lease_renew_deadline_seconds=2,
                            lease_retry_seconds=1)


async def _never() -> None:
    await asyncio.Event().wait()  # the operator itself: it must not start, or must be stopped


async def test_a_standby_whose_lease_thread_cannot_start_fails_naming_why() -> None:
    with pytest.raises(LeadershipLost, match=f"cannot reach the API server for the Lease: .*{NOWHERE}"):
        await asyncio.wait_for(lead_then_run(_settings(1), _never, kubeconfig=NOWHERE, fence=lambda code: None), 20)


async def test_a_sharded_replica_whose_lease_thread_cannot_start_fails_naming_why() -> None:
    with pytest.raises(LeadershipLost, match=f"cannot reach the API server for the Lease: .*{NOWHERE}"):
        await asyncio.wait_for(lead_shards_then_run(_settings(2), ShardSet(2), _never, kubeconfig=NOWHERE,
                                                    fence=lambda code: None), 20)
