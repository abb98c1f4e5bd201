"""ZigZag admission on a live B (livepolicy.ZigZagPolicy): a request's prefix comes from the plan for the queue
as it is when it arrives, requests grouped into batches by prompt tokens; a request reaching an idle B runs
with the resident layers at once instead of waiting for layers a t = 0 plan reserved for a burst."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from splitref import collect, unsplit
from test_pair import PROMPTS, _pair

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.live.livepolicy import ZigZagPolicy
from kascade_planner.engine_api import CooperateRequest
from kascade_planner.zigzag import PairSetting, ilp_free


def test_zigzag_batches_group_requests_by_prompt_tokens() -> None:
    """The queue ahead of a request, in prompt tokens, gives its batch: a request that fits the open batch
    gets that batch's prefix, one that does not opens the next; batch i's prefix is T_i of the plan for
    the i + 1 batches queued now (at load start here: nothing resident)."""
    setting = PairSetting(layers=8, load_ratio=8.0, batches=12)
    per_request = ZigZagPolicy(setting)
    grouped = ZigZagPolicy(setting, batch_tokens=100)
    t = [ilp_free(replace(setting, batches=i + 1)).target_layers[i] for i in range(4)]
    assert [per_request.next_target(0, 33, 33 * q, q) for q in range(4)] == t  # one batch per request
    # 33-token prompts: three fill a 100-token batch, the fourth opens the next one
    assert [grouped.next_target(0, 33, 33 * q, q) for q in range(7)] == [t[0]] * 3 + [t[1]] * 3 + [t[2]]
    fig15 = PairSetting(layers=7, load_ratio=6.0, batches=6)  # a queue there at t = 0: the t = 0 plan's T_i
    assert [ZigZagPolicy(fig15).next_target(0, 6, 6 * q, q) for q in range(6)] == list(ilp_free(fig15).target_layers)


def test_zigzag_replans_from_the_queue_as_it_is() -> None:
    """Issue 17: a request arriving to an engine with nothing queued is batch 0 of a one-batch plan made
    now, with the layers already here counted as loaded: it runs with what is resident (ILP-free) and is
    never held for layers a t = 0 plan reserved for a burst that did not queue. (The old policy gave the
    i-th admitted batch the t = 0 plan's T_i whatever the queue: here the second request waited for 2
    layers more than the one resident.)"""
    setting = PairSetting(layers=8, load_ratio=8.0, batches=12)
    t0_plan = ZigZagPolicy(setting).targets
    assert max(t0_plan[1:4]) > 1  # the t = 0 plan holds later batches for layers not resident yet
    lone = ZigZagPolicy(setting)
    assert [lone.next_target(r, 33) for r in (0, 1, 1, 3, 5)] == [0, 1, 1, 3, 5]
    # with a real queue ahead the plan can still hold: behind 2 batches, 1 layer here, a later batch waits
    queued = [ZigZagPolicy(setting).next_target(1, 33, 33 * q, q) for q in range(6)]
    assert queued == [ilp_free(replace(setting, batches=q + 1, elapsed=setting.load_ratio)).target_layers[q]
                      for q in range(6)]
    assert max(queued) > 1
    assert ZigZagPolicy(setting).next_target(1, 33, 33 * 12, 12) == 1  # past the horizon: the resident prefix


async def test_zigzag_serves_spread_out_requests_without_holding(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17: requests reaching a ZigZag B one after another (each done before the next comes) are each
    batch 0 of the queue as it is: they run at once with the resident layer, outputs exact. A t = 0 plan
    (the old policy) held the second for 3 layers that never land here (the request waited out the hold
    limit)."""
    setting = PairSetting(layers=4, load_ratio=2.0, batches=6)
    assert ZigZagPolicy(setting).targets[1] == 3  # what the t = 0 plan gives the second batch
    params = SamplingParams(max_tokens=4)
    want = unsplit(tiny_blocks, PROMPTS[:3], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        b = p.b
        await b.set_cooperate(CooperateRequest(p.peer, "zigzag"))
        assert b.pair is not None
        b.pair.policy = ZigZagPolicy(setting)
        assert b.serving_share == 1 / 4 and b.pair.peer_complete  # paired with a source: its own layers' share
        got = []
        for pr in PROMPTS[:3]:
            got.append(await asyncio.wait_for(collect(b, b.serving.submit(pr, params)), 10))
        assert got == want
        assert [k for _, k in b.pair.history] == [1, 1, 1]
        assert not b.pair.ahead and not b.pair.holding  # the queue it plans from is empty again
    finally:
        await p.close()
