"""Decode-state migration (live/migration.py): once a loading B holds every layer, the sequences it started split
move to it whole. A hands over their K/V of its layers and the sampler state and frees them; B checks the
sizes and writes the K/V into its own pages; outputs equal the unsplit engine's, greedy and seeded."""

from __future__ import annotations

import asyncio

import pytest
import torch
from splitref import collect, unsplit
from test_pair import PROMPTS, _pair

from kascade_engine.batch.kvcache import KVCache
from kascade_engine.batch.sampling import SamplingParams
from kascade_planner.engine_api import CooperateRequest


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40),
                                    SamplingParams(max_tokens=40, temperature=0.9, seed=11)], ids=["greedy", "seeded"])
async def test_split_sequences_migrate_to_b_once_it_holds_every_layer(tiny_ckpt, tiny_blocks, params) -> None:
    """Decode-state migration: sequences B started split finish on B alone once its last block lands. A
    hands over their K/V (and sampler state) and frees them; outputs equal the unsplit engine's."""
    want = unsplit(tiny_blocks, PROMPTS[:3], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        a, b = p.a, p.b
        a.host.layer_s = 0.005  # A's steps take a little time: generation is still going when layers land
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        rids = [b.serving.submit(pr, params) for pr in PROMPTS[:3]]
        runs = [asyncio.create_task(collect(b, r)) for r in rids]
        pc = b.pair
        assert pc is not None
        while pc.steps_sent < 5:  # a few tokens generated split
            await asyncio.sleep(0.005)
        assert a.host.lengths  # A holds their later layers
        for i in (1, 2, 3):
            b.add_block(tiny_blocks.blocks[f"layer.{i}"])
        b.add_block(tiny_blocks.blocks["head"])
        out = await asyncio.gather(*runs)
        assert out == want
        assert pc.migrated == 3 and a.host.migrated == 3  # every split sequence moved, none finished on A
        assert not a.host.lengths and not a.host.gens  # A freed them at once
        assert pc.steps_sent < 5 + params.max_tokens  # the rest of the decode ran on B alone
        assert b.engine.coop is b.host  # nothing split left: a plain engine again
    finally:
        await p.close()


def test_migrated_kv_is_checked_and_lands_in_the_right_slots(tiny_blocks) -> None:
    from kascade_engine.live import migration

    L = tiny_blocks.config.num_hidden_layers if hasattr(tiny_blocks.config, "num_hidden_layers") else 4
    src = KVCache(L, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    dst = KVCache(L, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    src.k.normal_()
    dst.k.zero_()
    dst.v.zero_()
    src.v.normal_()
    payload = migration.take(src, [3, 5], 1, 6)  # positions 0..5 live on pages 3 and 5 there
    assert len(payload) == migration.kv_bytes(src, L - 1, 6)
    migration.put(dst, [6, 2], 1, 6, memoryview(payload))  # and on pages 6 and 2 here
    here = torch.tensor([24, 25, 26, 27, 8, 9])
    there = torch.tensor([12, 13, 14, 15, 20, 21])
    for layer in range(1, L):
        assert torch.equal(dst.k[layer][here], src.k[layer][there]) and torch.equal(
            dst.v[layer][here], src.v[layer][there]
        )
    assert not dst.k[0][here].any()  # layers below k stay as they were
    with pytest.raises(ValueError, match="bytes"):
        migration.put(dst, [6, 2], 1, 5, memoryview(payload))
    with pytest.raises(ValueError, match="base64"):
        migration.set_gen_state(torch.Generator(), 42)
