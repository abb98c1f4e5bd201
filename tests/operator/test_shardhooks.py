"""A ScalePlan's daemon with shards (shardhooks.drive_owned): it drives the plan only while the plan's shard is
held here, and re-checks that after every wait, the re-read of the plan included (the real ShardSet, the fake
kube layer)."""

from __future__ import annotations

import asyncio
from typing import Any

from fakekube import FakeKube
from stubruntime import Stopped, stub_runtime

from kascade_operator.shardhooks import drive_owned
from kascade_operator.shardset import ShardSet

NS = "team-a"


async def test_a_shard_given_back_while_the_plan_is_re_read_is_not_driven_until_held_again() -> None:
    kube = FakeKube()
    plan = await kube.create_scaleplan(NS, {"metadata": {"name": "p1"}, "spec": {}, "status": {"phase": "Live"}})
    async with stub_runtime(kube, [], "t") as rt:
        shards = rt.shards = ShardSet(3)
        k = shards.shard(rt.pool_namespace(NS))
        driven: list[tuple[dict[str, Any], bool]] = []

        async def drive(rt_: Any, body: dict[str, Any], stopped: Any) -> None:
            driven.append((body, shards.owns(NS)))

        reads = 0
        read = kube.get_scaleplan

        async def read_then_given_back(ns: str, name: str) -> dict[str, Any]:
            nonlocal reads
            reads += 1
            body = await read(ns, name)
            if reads == 1:  # the lease was lost (or given to a joining replica) during the read
                shards.drop(k)
            return body

        kube.get_scaleplan = read_then_given_back
        task = asyncio.create_task(drive_owned(rt, plan, Stopped(), drive))
        await asyncio.sleep(0.05)
        assert driven == [] and not task.done()  # not held here: it waits
        shards.hold(k)
        await asyncio.sleep(0.05)
        assert reads == 1 and driven == [] and not task.done()  # given back meanwhile: waits again
        shards.hold(k)
        await asyncio.wait_for(task, 5)
        assert reads == 2 and [owned for _, owned in driven] == [True]
        assert driven[0][0]["metadata"]["name"] == "p1"
