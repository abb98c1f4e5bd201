"""Cooperative execution inside the batch: a loading engine B (a prefix of the layers) paired with a full
engine A over one authenticated TCP connection. B batches its requests, runs its prefix for the whole
step and sends one activation tensor per step; A finishes those rows inside its own batch, next to its
own requests. Outputs equal the unsplit engine's (batched, greedy and seeded) for both engines'
requests, the split point moves forward as blocks arrive, and no per-request connection is opened."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from splitref import collect, unsplit

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import CooperateRequest, Phase

PROMPTS = [[11, 42, 7, 300, 5], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17], [100], [5, 6, 7, 8]]


def _instance(ckpt: Path, blocks: Any, resident: int | None, name: str) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token="pair-token", kv_tokens=2048,
                       max_batch_tokens=64, instance=name, resident_layers=resident)
    return EngineInstance(cfg, blocks.config, ByteTokenizer(), blocks)


class Pair:
    def __init__(self, a: EngineInstance, b: EngineInstance, listener: Any) -> None:
        self.a, self.b, self.listener = a, b, listener

    @property
    def peer(self) -> str:
        return f"127.0.0.1:{self.listener.port}"

    async def close(self) -> None:
        await self.b.close()
        await self.a.close()
        await self.listener.close()


async def _pair(tiny_ckpt: Path, tiny_blocks: Any, resident: int) -> Pair:
    a = _instance(tiny_ckpt, tiny_blocks, None, "a")
    b = _instance(tiny_ckpt, tiny_blocks, resident, "b")
    a.serving.start()
    b.serving.start()
    listener = await TcpTransport().listen("127.0.0.1", 0, a.finisher.handle)
    return Pair(a, b, listener)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=6),
                                    SamplingParams(max_tokens=5, temperature=0.8, seed=7)], ids=["greedy", "seeded"])
async def test_pair_formed_while_a_serves_a_batch_is_exact(tiny_ckpt, tiny_blocks, params) -> None:
    want = unsplit(tiny_blocks, PROMPTS, params)
    assert len({t for w in want for t in w}) > 3  # a degenerate model would make the comparison meaningless
    p = await _pair(tiny_ckpt, tiny_blocks, resident=2)
    try:
        a, b = p.a, p.b
        with pytest.raises(Exception, match="no cooperating peer"):
            b.serving.submit(PROMPTS[0], params)
        a_rids = [a.serving.submit(pr, params) for pr in PROMPTS]  # A is serving a batch ...
        a_runs = [asyncio.create_task(collect(a, r)) for r in a_rids]
        await asyncio.sleep(0)
        await b.set_cooperate(CooperateRequest(p.peer, "besteffort"))  # ... when the pair forms
        assert b.phase is Phase.LIVE and a.finisher.pairs == 1
        # one long request of A's own stays in A's batch while B's rows arrive (so a shared forward is
        # certain, not a matter of which engine's thread runs first); aborted once B is done
        long = a.serving.submit(PROMPTS[0], SamplingParams(max_tokens=400))
        b_rids = [b.serving.submit(pr, params) for pr in PROMPTS]
        a_rids2 = [a.serving.submit(pr, params) for pr in PROMPTS[:2]]
        b_out = await asyncio.gather(*(collect(b, r) for r in b_rids))
        a.serving.abort(long)
        a_out = await asyncio.gather(*a_runs, *(collect(a, r) for r in a_rids2))
        assert b_out == want
        assert a_out == want + want[:2]
        pc = b.pair
        assert pc is not None and pc.tokens_sent > 0
        assert pc.steps_sent <= params.max_tokens + 2  # one frame per B step for all 5 requests, not per request
        assert a.host.shared_steps >= 1  # B's rows and A's own requests ran in the same forward
        assert a.host.rows_hosted > len(PROMPTS)  # B's rows ran in A's steps
        assert a.finisher.connections == 1  # one connection for the pair, none per request
        assert pc.bytes_sent == pc.tokens_sent * 64 * 4  # hidden x float32 per token, nothing else
    finally:
        await p.close()


async def test_split_moves_forward_as_blocks_arrive_and_b_goes_local(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        a, b = p.a, p.b
        await b.set_cooperate(CooperateRequest(p.peer, "zigzag"))
        first = b.serving.submit(PROMPTS[0], params)
        run1 = asyncio.create_task(collect(b, first))
        while not b.pair or first not in b.pair.split:
            await asyncio.sleep(0.005)
        assert b.pair.split[first] == 1
        for i in (1, 2):
            b.add_block(tiny_blocks.blocks[f"layer.{i}"])
        second = b.serving.submit(PROMPTS[1], params)
        run2 = asyncio.create_task(collect(b, second))
        while second not in b.pair.split:
            await asyncio.sleep(0.005)
        assert b.pair.split[second] == 3  # admitted later: the longer prefix; the first keeps k = 1
        assert b.pair.split.get(first, 1) == 1
        assert await run1 == want[0] and await run2 == want[1]
        b.add_block(tiny_blocks.blocks["layer.3"])
        b.add_block(tiny_blocks.blocks["head"])
        assert b.phase is Phase.SERVING
        pc = b.pair
        sent = pc.steps_sent
        assert await collect(b, b.serving.submit(PROMPTS[2], params)) == unsplit(tiny_blocks, [PROMPTS[2]], params)[0]
        assert pc.steps_sent <= sent + 1  # fully loaded: runs here (at most one step carries the ends)
        assert b.engine.coop is b.host and a.finisher.connections == 1
    finally:
        await p.close()


async def test_pair_refused_with_wrong_token_or_dead_peer(tiny_ckpt, tiny_blocks) -> None:
    p = await _pair(tiny_ckpt, tiny_blocks, resident=2)
    try:
        p.a.finisher.token = "other-token"
        with pytest.raises(InstanceError, match="cannot pair") as e:
            await p.b.set_cooperate(CooperateRequest(p.peer, "besteffort"))
        assert e.value.status == 502 and e.value.field == "peer"
        with pytest.raises(InstanceError, match="must be host:port"):
            await p.b.set_cooperate(CooperateRequest("nohost", "besteffort"))
        assert p.b.pair is None and p.a.host.rows_hosted == 0
    finally:
        await p.close()


async def test_standby_warms_the_pair_connection_so_pairing_pays_no_handshake(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=4)
    p = await _pair(tiny_ckpt, tiny_blocks, resident=3)
    c = _instance(tiny_ckpt, tiny_blocks, 1, "c")  # a second loading engine, never warmed
    c.serving.start()
    try:
        a, b = p.a, p.b
        await b.set_cooperate(CooperateRequest(p.peer, "standby"))  # at bind / pool join
        assert b.peers.handshakes == 1 and a.finisher.connections == 1
        assert b.phase is Phase.LOADING and b.pair is None  # standby serves nothing yet
        await b.set_cooperate(CooperateRequest(p.peer, "zigzag"))  # the scale-up: no handshake now
        assert b.peers.handshakes == 1 and b.peers.reused == 1 and a.finisher.connections == 1
        await c.set_cooperate(CooperateRequest(p.peer, "zigzag"))  # baseline: pays its handshake now
        assert c.peers.handshakes == 1 and c.peers.reused == 0 and a.finisher.connections == 2
        want = unsplit(tiny_blocks, PROMPTS[:3], params)
        outs = await asyncio.gather(*(collect(e, e.serving.submit(pr, params)) for e in (b, c) for pr in PROMPTS[:3]))
        assert outs == want + want and a.finisher.connections == 2 and a.finisher.pairs == 2
        with pytest.raises(InstanceError, match="cannot reach peer"):
            await c.set_cooperate(CooperateRequest("127.0.0.1:1", "standby"))
    finally:
        await c.close()
        await p.close()


@pytest.fixture(scope="module")
def fig15_blocks(tmp_path_factory: pytest.TempPathFactory):
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_engine.weights.checkpoint import tiny_llama

    ckpt = tiny_llama(tmp_path_factory.mktemp("fig15") / "tiny-llama", layers=7, hidden=64, vocab=512)
    return ckpt, pack_checkpoint(ckpt, model="tiny-llama")


@pytest.mark.parametrize("ilp", [False, True], ids=["ilp-free", "ilp"])
async def test_fig15_engine_follows_the_planners_zigzag(fig15_blocks, ilp: bool) -> None:
    """BlitzScale Figure 15's setting in the engine: 7 layers, loading a layer = 6 layer computations,
    6 batches queued at t=0 on the loading engine. Each batch waits for its scheduled prefix (planner's
    ZigZag), runs it here and finishes on the pair: the measured completion order agrees with the
    planner's predicted order within one batch slot, and every output equals the unsplit engine's."""
    from kascade_engine.live.livepolicy import ZigZagPolicy
    from kascade_planner.zigzag import PairSetting, ilp_free, zigzag_ilp

    ckpt, blocks = fig15_blocks
    setting = PairSetting(layers=7, load_ratio=6.0, batches=6)
    predicted = (zigzag_ilp(setting) if ilp else ilp_free(setting)).finish
    params = SamplingParams(max_tokens=1)
    prompts = [[7 * i + j for j in range(6)] for i in range(6)]
    want = unsplit(blocks, prompts, params)
    p = await _pair(ckpt, blocks, resident=0)
    try:
        b = p.b
        await b.set_cooperate(CooperateRequest(p.peer, "zigzag"))
        assert b.pair is not None
        b.pair.policy = ZigZagPolicy(setting, ilp=ilp)
        # one layer computation of one batch, in s (the tiny model takes well under 1 ms). The schedule is
        # emulated on the wall clock, so a process starved of the CPU skews it: at 30 ms a unit, the whole
        # schedule took 1.3 s, and one 0.5 s stall beside a CI run plus 2 busy CPUs (load ~8 on 2 cores) moved
        # 5 batches' finishes to the same moment (1 of 6 runs); at 100 ms a stall that long is 5 units
        unit = 0.1
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def load() -> None:  # the link: layer l lands at (l+1)·6 units
            for i in range(7):
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 6 * unit - loop.time()))
                b.add_block(blocks.blocks[f"layer.{i}"])
            b.add_block(blocks.blocks["head"])

        async def one(i: int) -> tuple[int, float, list[int]]:
            out = await collect(b, b.serving.submit(prompts[i], params))
            return i, (loop.time() - t0) / unit, out

        loader = asyncio.create_task(load())
        done = await asyncio.gather(*(one(i) for i in range(6)))
        await loader
        assert [d[2] for d in done] == want
        measured = [i for i, _, _ in sorted(done, key=lambda d: d[1])]
        expected = sorted(range(6), key=lambda i: (predicted[i], i))
        finish = [round(d[1], 1) for d in sorted(done)]  # each batch's, in units
        assert all(abs(measured.index(i) - expected.index(i)) <= 1 for i in range(6)), (measured, expected, finish)
        ks = dict(b.pair.history)
        assert [ks[r] for r in b.pair.admitted_ids] == list(b.pair.policy.targets)  # each ran its scheduled prefix
        print(f"fig15 {'ilp' if ilp else 'ilp-free'}: measured order {measured} (finish, units: "
              f"{finish}), predicted {expected} {predicted}")
    finally:
        await p.close()


async def test_cooperate_carries_the_operators_zigzag_setting(tiny_ckpt, tiny_blocks) -> None:
    from kascade_planner.engine_api import WireError
    from kascade_planner.zigzag import PairSetting, ilp_config, ilp_free

    req = CooperateRequest.from_dict(
        {"peer": "h:1", "mode": "zigzag", "zigzag": {"loadRatio": 6, "batches": 5, "ilp": True}}
    )
    assert CooperateRequest.from_dict(req.to_dict()) == req
    for bad, name in (
        ({"loadRatio": -1, "batches": 2}, "zigzag.loadRatio"),
        ({"loadRatio": 1, "batches": 0}, "zigzag.batches"),
        ({"loadRatio": 1, "batches": 2, "ilp": "yes"}, "zigzag.ilp"),
        ({"loadRatio": 1, "batches": 2, "x": 1}, "zigzag.x"),
    ):
        with pytest.raises(WireError) as e:
            CooperateRequest.from_dict({"peer": "h:1", "mode": "zigzag", "zigzag": bad})
        assert e.value.field == name
    with pytest.raises(WireError, match="only with mode zigzag"):
        CooperateRequest.from_dict({"peer": "h:1", "mode": "besteffort", "zigzag": {"loadRatio": 1, "batches": 2}})
    p = await _pair(tiny_ckpt, tiny_blocks, resident=1)
    try:
        for ilp in (False, True):
            z = {"loadRatio": 6, "batches": 5, "ilp": ilp}
            await p.b.set_cooperate(CooperateRequest.from_dict({"peer": p.peer, "mode": "zigzag", "zigzag": z}))
            assert p.b.pair is not None and p.b.pair.policy is not None
            s = PairSetting(4, 6.0, 5)
            assert p.b.pair.policy.targets == (ilp_config(s) if ilp else ilp_free(s).target_layers)
    finally:
        await p.close()
