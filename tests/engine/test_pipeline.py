"""Execute-while-load pipelines (λScale Alg. 2) in the engine: three receivers holding different layer
ranges serve together before any holds the whole model — receiver 1 (embed, layers 0-1) batches the
requests and runs its layers, receiver 2 (layer 2) runs its layer inside its own step and passes the
rows on, receiver 3 (layer 3, head) finishes and samples; outputs equal the unsplit engine's. A
receiver dying mid-pipeline fails only the in-flight requests; the pipeline re-forms around a
replacement and serves exactly again; as blocks complete, receiver 1 dissolves into a plain replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from splitref import collect, unsplit

from kascade_devcluster.waiting import wait_until
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.live.pairclient import PIPELINE_DEPTH, PIPELINE_DEPTH_PER_RECEIVER
from kascade_engine.net.transport import Listener
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import CooperateRequest, Phase

PROMPTS = [[11, 42, 7, 300, 5], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17]]


def _receiver(tiny_ckpt: Any, blocks: Any, ids: list[str], name: str) -> EngineInstance:
    cfg = EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token="pipe-token", kv_tokens=2048,
                       max_batch_tokens=64, instance=name)
    inst = EngineInstance(cfg, blocks.config, ByteTokenizer(), None)
    for bid in ids:
        inst.add_block(blocks.blocks[bid])
    inst.serving.start()
    return inst


@dataclass
class Pipeline:
    r1: EngineInstance  # embed, layers 0-1: the head, where requests arrive
    r2: EngineInstance  # layer 2
    r3: EngineInstance  # layer 3 and the head
    spare: EngineInstance | None  # a second r3 (a replacement), when asked for
    listeners: list[Listener]  # one per instance, in that order (r1, r2, r3[, spare])

    def peer(self, inst: EngineInstance) -> str:
        insts = [self.r1, self.r2, self.r3, *([self.spare] if self.spare else [])]
        return f"127.0.0.1:{self.listeners[insts.index(inst)].port}"


@asynccontextmanager
async def _pipeline(
    tiny_ckpt: Any, blocks: Any, last_layer_s: float = 0.0, spare: bool = False
) -> AsyncIterator[Pipeline]:
    """Three receivers formed into r1 -> r2 -> r3 (`last_layer_s`: r3's emulated time per layer), closed after."""
    r1 = _receiver(tiny_ckpt, blocks, ["embed", "layer.0", "layer.1"], "r1")
    r2 = _receiver(tiny_ckpt, blocks, ["layer.2"], "r2")
    r3 = _receiver(tiny_ckpt, blocks, ["layer.3", "head"], "r3")
    r3.host.layer_s = last_layer_s
    extra = _receiver(tiny_ckpt, blocks, ["layer.3", "head"], "r3-spare") if spare else None
    insts = [r1, r2, r3, *([extra] if extra else [])]
    listeners = [await TcpTransport().listen("127.0.0.1", 0, i.finisher.handle) for i in insts]
    p = Pipeline(r1, r2, r3, extra, listeners)
    try:
        await r2.set_cooperate(CooperateRequest(p.peer(r3), "pipeline"))
        await r1.set_cooperate(CooperateRequest(p.peer(r2), "besteffort"))
        yield p
    finally:
        for i in insts:
            await i.close()
        for lst in listeners:
            await lst.close()


async def test_pipeline_of_three_receivers_serves_exactly_and_survives_a_death(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS, params)
    async with _pipeline(tiny_ckpt, tiny_blocks, spare=True) as pl:
        r1, r2, r3, spare = pl.r1, pl.r2, pl.r3, pl.spare
        assert spare is not None
        assert not any(i.model.complete for i in (r1, r2, r3, spare))  # no receiver holds the whole model
        assert r1.phase is Phase.LIVE
        got = await asyncio.gather(*(collect(r1, r1.serving.submit(p, params)) for p in PROMPTS))
        assert got == want
        await wait_until(lambda: r3.host.rows_hosted == r2.host.rows_hosted, 5, "every row to go r1->r2->r3")
        assert r2.host.rows_hosted > 0
        assert r2.finisher.connections == 1 and r3.finisher.connections == 1  # one per hop, none per request

        # receiver 3 dies mid-pipeline: the in-flight requests fail, nothing else does
        long = SamplingParams(max_tokens=40)
        before = r3.host.steps_hosted
        inflight = [r1.serving.submit(p, long) for p in PROMPTS[:2]]
        runs = [asyncio.create_task(collect(r1, r)) for r in inflight]
        while r3.host.steps_hosted < before + 2:  # they are mid-generation
            await asyncio.sleep(0.005)
        await pl.listeners[2].close()
        assert r2.host.downstream is not None
        await r2.host.downstream.conn.close()  # its connection goes down with it
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results)
        # the pipeline re-forms around a replacement receiver and serves exactly again
        await r2.set_cooperate(CooperateRequest(pl.peer(spare), "pipeline"))
        got = await asyncio.gather(*(collect(r1, r1.serving.submit(p, params)) for p in PROMPTS))
        assert got == want and spare.host.rows_hosted > 0

        # blocks complete: receiver 1 dissolves into an independent replica (no pipeline rows for new requests)
        for bid in ("layer.2", "layer.3", "head"):
            r1.add_block(tiny_blocks.blocks[bid])
        assert r1.phase is Phase.SERVING
        hosted = r2.host.rows_hosted
        assert await collect(r1, r1.serving.submit(PROMPTS[0], params)) == want[0]
        assert r2.host.rows_hosted == hosted


@pytest.mark.parametrize("held", [["layer.2"]])
async def test_middle_receiver_without_a_downstream_refuses_rows(tiny_ckpt, tiny_blocks, held) -> None:
    r1 = _receiver(tiny_ckpt, tiny_blocks, ["embed", "layer.0", "layer.1"], "r1")
    r2 = _receiver(tiny_ckpt, tiny_blocks, held, "r2")
    lst = await TcpTransport().listen("127.0.0.1", 0, r2.finisher.handle)
    try:
        await r1.set_cooperate(CooperateRequest(f"127.0.0.1:{lst.port}", "besteffort"))
        with pytest.raises(Exception, match="layer 3 is not resident here and no pipeline follows"):
            await collect(r1, r1.serving.submit(PROMPTS[0], SamplingParams(max_tokens=2)))
    finally:
        await r1.close()
        await r2.close()
        await lst.close()


async def test_middle_receiver_gaining_layers_keeps_each_sequences_range(tiny_ckpt, tiny_blocks) -> None:
    """Blocks keep landing on a middle receiver while sequences decode through it: a sequence that began
    with layer 3 downstream keeps it there (its KV for layer 3 lives there), a sequence admitted after
    the block landed runs layer 3 in the middle; both are exact."""
    params = SamplingParams(max_tokens=16)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    async with _pipeline(tiny_ckpt, tiny_blocks) as pl:
        r1, r2, r3 = pl.r1, pl.r2, pl.r3
        first = asyncio.create_task(collect(r1, r1.serving.submit(PROMPTS[0], params)))
        while r3.host.steps_hosted < 3:  # the first sequence is decoding through r1 -> r2 -> r3
            await asyncio.sleep(0.005)
        r2.add_block(tiny_blocks.blocks["layer.3"])  # r2 now holds layers 2-3, not the head
        second = asyncio.create_task(collect(r1, r1.serving.submit(PROMPTS[1], params)))
        while len(r2.host.stops) < 2 and not first.done():  # both sequences have rows on r2
            await asyncio.sleep(0.002)
        stops = sorted(r2.host.stops.values())
        assert [await first, await second] == want
        assert stops == [3, 4]  # the first keeps its range (layer 2 only), the second runs layers 2-3 here


async def test_a_middle_receiver_runs_its_next_step_while_rows_are_downstream(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17, λScale's pipelining: a middle receiver does not wait inside its step for the next receiver's
    answer. With a slow last receiver, the middle one relays a second step while the first is still
    there (before: one relayed step at a time, so the pipeline ran one step of all its stages at once and
    served no faster than one replica). Outputs stay exact, one connection per hop."""
    params = SamplingParams(max_tokens=6)
    prompts = PROMPTS * 3
    want = unsplit(tiny_blocks, prompts, params)
    # the last stage's steps take a while: earlier stages have time to go on. 0.15 s a layer, not 0.05: at load
    # 20 the head's own steps (and the 10 ms between submissions) stretched enough that only 3 were out while
    # r3 ran one (a CI-style run failed on `max_inflight > PIPELINE_DEPTH`); the property is the same.
    async with _pipeline(tiny_ckpt, tiny_blocks, last_layer_s=0.15) as pl:
        r1, r2, r3 = pl.r1, pl.r2, pl.r3
        # the head of a pipeline loads no source: routers weigh it by the pipeline's capacity, not by its 2 of 4
        # layers nor as one replica: three receivers (r1, r2, r3), but its 2-layer steps admit 4 / 2 times as
        # often as whole-model steps: 2
        assert r1.serving_share == 2.0 and r1.pair is not None and not r1.pair.peer_complete
        assert r1.pair.peer_receivers == 2 and r2.pair is None and r2.host.downstream is not None
        got = []
        for p in prompts:  # one at a time: the head's steps go out one after another, each with few rows
            got.append(asyncio.create_task(collect(r1, r1.serving.submit(p, params))))
            await asyncio.sleep(0.01)
        assert await asyncio.gather(*got) == want
        assert r2.host.max_relays_out >= 2
        # the head keeps more steps out than a pair with a source does: a round trip crosses both receivers
        assert r1.pair.depth == PIPELINE_DEPTH_PER_RECEIVER * 2 and r1.pair.max_inflight > PIPELINE_DEPTH
        for _ in range(200):  # the last frame may carry only the finished sequences' ends: its answer follows
            if r2.host.relays_out == 0:
                break
            await asyncio.sleep(0.01)
        assert r2.host.relays_out == 0  # every relayed frame was answered
        assert r2.finisher.connections == 1 and r3.finisher.connections == 1


async def test_a_pipeline_head_keeps_its_stage_as_its_layers_land(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17: the head of a pipeline admits every request, so its step time bounds the pipeline. It runs
    its stage (the prefix it held when the pipeline formed) of each new sequence, not its growing prefix:
    with layer 2 landed on the head, a new sequence still leaves layer 2 to the next receiver (before: k
    grew with the prefix, and in bench pipe4 the head's steps grew to a source's, 3 prompts per 0.65 s).
    Outputs stay exact."""
    params = SamplingParams(max_tokens=4)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    async with _pipeline(tiny_ckpt, tiny_blocks) as pl:
        r1, r2 = pl.r1, pl.r2
        assert r1.pair is not None
        first = await collect(r1, r1.serving.submit(PROMPTS[0], params))
        r1.add_block(tiny_blocks.blocks["layer.2"])  # the head's prefix is 3 layers now
        second = await collect(r1, r1.serving.submit(PROMPTS[1], params))
        assert [first, second] == want
        assert [k for _, k in r1.pair.history] == [2, 2]  # (its prefix: [2, 3])
        assert r1.pair.stage == 2
        # re-formed with the head holding layers 0-2 and r2 holding 2: the layer both hold runs on r2
        await r1.set_cooperate(CooperateRequest("", "off"))
        await r1.set_cooperate(CooperateRequest(pl.peer(r2), "besteffort"))
        assert r1.pair is not None and r1.pair.peer_first == 2 and r1.pair.stage == 2
        assert await collect(r1, r1.serving.submit(PROMPTS[0], params)) == want[0]
        assert r2.host.rows_hosted >= 2 * params.max_tokens  # layer 2 of both ran on r2, every token


async def test_a_complete_pipeline_head_pipelines_its_queue_then_runs_alone(tiny_ckpt, tiny_blocks) -> None:
    """Issue 17: requests queued on a pipeline head were routed to it at the pipeline's rate (its serving share).
    Once the head holds every layer it keeps starting them at its stage while a queue waits (its stage steps
    admit faster than whole-model steps; before, the queue drained at one replica's rate: bench pipe4, the
    worst requests waited 7 s on the head), and runs new sequences whole once the queue is gone. Exact."""
    params = SamplingParams(max_tokens=2)
    prompts = [[i + j for j in range(40)] for i in range(6)]  # 40 tokens: one per 64-token step (whole prompts)
    want = unsplit(tiny_blocks, prompts, params)
    # the last stage takes a moment per step: the head's queue is still there when it completes
    async with _pipeline(tiny_ckpt, tiny_blocks, last_layer_s=0.02) as pl:
        r1 = pl.r1
        assert r1.pair is not None
        runs = [asyncio.create_task(collect(r1, r1.serving.submit(p, params))) for p in prompts]
        while not r1.pair.history:
            await asyncio.sleep(0.002)
        for bid in ("layer.2", "layer.3", "head"):  # the head completes with most of its queue still waiting
            r1.add_block(tiny_blocks.blocks[bid])
        assert r1.phase is Phase.SERVING and len(r1.engine.scheduler.waiting) >= 3
        before = len(r1.pair.history)
        assert await asyncio.gather(*runs) == want
        ks = [k for _, k in r1.pair.history[before:]]
        assert ks[0] == 2 and ks[-1] == 4, ks  # queued: at its stage; the last one, nothing queued behind it: whole
