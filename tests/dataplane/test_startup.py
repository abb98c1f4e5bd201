"""Peers of a transfer start concurrently: a node whose downstream is not listening yet keeps dialling it for
`timeoutSeconds` (forwarding.Forwarding._connect_retrying), and meanwhile what it receives waits in that
downstream's queue. A downstream that comes up within that budget gets the whole stream, with nothing dropped
and nothing re-fetched; one that never comes up is dropped as lost once the budget is spent, and the chain above
it finishes. Before, the lag rule counted the dialling: a relay dropped a downstream that began listening 0.3 s
after it as lagging, and that downstream re-fetched everything from a fallback (the fault matrix's cells then
recovered from a fault that had not happened yet)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest

from kascade_devcluster.ports import free_ports
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout
from kascade_planner.topology import leaf_spine

T = 4.0  # timeoutSeconds: each node's connect budget for its downstream; a relay's lag limit is T / 2
# how long after the others the late node starts listening: past the lag limit (the old rule dropped it as lagging
# at ~T / 2 while it was still being dialled), inside the connect budget (the new rule waits for it)
LATE_S = 0.75 * T
# the source's pace, MB/s: the queue for a downstream not listening yet fills (1 MiB) within ~0.1 s, and one that
# is connected keeps up with it, also on a loaded machine (unpaced, the three nodes share this one event loop and
# a relay was kept waiting past its lag limit by a downstream that was listening: 1 of 5 runs at load 29)
RATE_MBPS = 8.0
NODES = ("s0", "t0", "t1")


def _chain_spec(blocks: BlockSet) -> TransferSpec:
    """s0 -> t0 -> t1 over loopback, 4 KiB chunks (a block is far more frames than a downstream queue holds, so
    the queue of a downstream not listening yet fills within milliseconds)."""
    topo = leaf_spine(1, len(NODES), 8)
    names = [x.name for x in topo.nodes]
    model = ModelLayout("tiny", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", names[0])], [Instance(t, names[i + 1]) for i, t in
                                                               enumerate(NODES[1:])], "chain")
    ports = dict(zip(NODES, free_ports(len(NODES)), strict=True))
    return TransferSpec(plan, blocks.manifest(), {k: ("127.0.0.1", v) for k, v in ports.items()},
                        secrets.token_hex(16), 4096, T, {"s0": {"rateMBps": RATE_MBPS}})


async def _node(spec: TransferSpec, me: str, blocks: BlockSet, late_s: float) -> dict[str, Any]:
    """One participant started `late_s` after the call, run to the end and closed."""
    await asyncio.sleep(late_s)
    node = TransferNode(spec, me, TcpTransport(), blocks if me == "s0" else None)
    await node.start()
    try:
        summary = await node.run()
        assert all(node.resident[b].verify() for b in blocks.ids)
        return summary
    finally:
        await node.close()


@pytest.mark.parametrize("late", ["t0", "t1"], ids=["first-target-late", "relays-downstream-late"])
async def test_a_downstream_listening_late_within_the_budget_gets_the_whole_stream(tiny_blocks: BlockSet,
                                                                                    late: str) -> None:
    spec = _chain_spec(tiny_blocks)
    got = await asyncio.wait_for(asyncio.gather(
        *(_node(spec, me, tiny_blocks, LATE_S if me == late else 0.0) for me in NODES)), 10 * T)
    for summary in got:
        assert summary["resident"] == len(tiny_blocks.ids)
        assert summary["downstreamLost"] == {}, summary  # nobody dropped a peer that was still starting
        assert summary["refetches"] == 0, summary  # everything came down the chain: nothing recovered


async def test_a_downstream_that_never_listens_is_lost_after_the_budget_and_the_chain_finishes(
        tiny_blocks: BlockSet) -> None:
    spec = _chain_spec(tiny_blocks)
    src, relay = await asyncio.wait_for(asyncio.gather(
        *(_node(spec, me, tiny_blocks, 0.0) for me in NODES[:2])), 10 * T)
    assert relay["resident"] == len(tiny_blocks.ids) and src["downstreamLost"] == {}
    assert str(relay["downstreamLost"].get("t1", "")).startswith("lost: connect"), relay  # dialled, not lagging
