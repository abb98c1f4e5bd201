"""The operator runs live execution on real engines: λScale execution pipelines from `plan.pipelines`
(standby at instruct time, formed tail first once the members cover every layer, re-formed around a
dropped member, stopped when the rest cannot serve) and BlitzScale live pairs with the ZigZag setting.

Engines are real `EngineInstance`s behind their real HTTP control API (uvicorn, in this process) and
real activation listeners (TCP); the operator side is the real `EngineClient` and the `livewiring`
functions the plan driver calls. Only the Kubernetes API is the in-memory FakeKube (the pod annotation
`kascade.io/live` is what is asserted there)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fakekube import FakeKube

from kascade_devcluster.waiting import wait_until
from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.http.server import create_app
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.tokenizer import ByteTokenizer
from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_operator import labels as L
from kascade_operator import livewiring as LW
from kascade_operator.engine_client import EngineClient
from kascade_operator.metrics import Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.pool import PodView
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings
from kascade_planner.engine_api import Phase

TOKEN = "live-wiring-token"
NS = "pool"
PROMPTS = [[11, 42, 7, 300, 5], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17]]


def _blocks(*ids: str) -> dict[str, bool]:
    names = ["embed", *(f"layer.{i}" for i in range(4)), "head"]
    return {b: b in ids for b in names}


def _st(*ids: str, **kw: Any) -> dict[str, Any]:
    return {"blocks": _blocks(*ids), **kw}


def test_chain_to_form_follows_the_engines_rules() -> None:
    ms = ("a", "b", "c")
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0"), "b": _st("layer.1", "layer.2"),
                                 "c": _st("layer.3", "head")}) == ("a", "b", "c")
    # b reaches the last layer and holds the head: c is not needed
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0"), "b": _st("layer.1", "layer.2", "layer.3", "head"),
                                 "c": _st()}) == ("a", "b")
    # b reaches the last layer without the head: c samples with zero layers of its own
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0"), "b": _st("layer.1", "layer.2", "layer.3"),
                                 "c": _st("head")}) == ("a", "b", "c")
    # a member that would add no layer is left out (no idle hop)
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0", "layer.1", "layer.2"), "b": _st("layer.0"),
                                 "c": _st("layer.3", "head")}) == ("a", "c")
    # a gap (layer.2 nowhere in order) -> none; the head without embed -> none; unknown member -> none
    assert (
        LW.chain_to_form(ms, {"a": _st("embed", "layer.0"), "b": _st("layer.1"), "c": _st("layer.3", "head")}) is None
    )
    assert (
        LW.chain_to_form(ms, {"a": _st("layer.0"), "b": _st("layer.1", "layer.2"), "c": _st("layer.3", "head")}) is None
    )
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0"), "b": None, "c": _st("layer.3", "head")}) is None
    # a complete head serves alone
    assert LW.chain_to_form(ms, {"a": _st("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head"),
                                 "b": _st(), "c": _st()}) is None
    # what runs now, read back from the statuses
    act = {"a": "h:1", "b": "h:2", "c": "h:3"}
    assert LW.formed_chain(ms, {"a": _st(cooperate={"peer": "h:2"}), "b": _st(pipelineDownstream="h:3"), "c": _st()},
                           act) == ("a", "b", "c")
    assert LW.formed_chain(ms, {"a": _st(cooperate={"peer": "h:3"}), "b": _st(), "c": _st()}, act) == ("a", "c")
    assert LW.formed_chain(ms, {"a": _st(cooperate={"peer": "h:9"}), "b": _st(), "c": _st()}, act) == ("a", "?")
    assert LW.formed_chain(ms, {"a": _st(), "b": _st(), "c": _st()}, act) == ()
    assert LW.pipelines_of({"pipelines": [["x"], ["a", "b"]]}) == [("a", "b")]


def test_zigzag_setting_comes_from_the_plans_prediction() -> None:
    spec = {"blockOrder": ["embed", "layer.0", "layer.1", "head"],
            "targets": [{"instance": "t", "predictedSeconds": 0.8}, {"instance": "u"}]}
    z = LW.zigzag_for(spec, "t", 0.01, 6, True)
    assert z is not None and z.load_ratio == pytest.approx(20.0) and z.batches == 6 and z.ilp
    assert LW.zigzag_for(spec, "u", 0.01, 6, False) is None  # no prediction: best effort


@dataclass
class Live:
    """One real engine: HTTP control API + activation listener, in this process."""

    inst: EngineInstance
    server: uvicorn.Server
    task: asyncio.Task[None]
    act: Any
    http_port: int

    @property
    def pod(self) -> PodView:
        iid = self.inst.instance_id
        return PodView(pod_name=iid, node="n0", resource_version="1", pool=True, model_service="svc", role="colocated",
                       ready=False, endpoint=f"127.0.0.1:{self.http_port}", act_endpoint=f"127.0.0.1:{self.act.port}",
                       instance=iid)

    async def close(self) -> None:
        self.server.should_exit = True
        await self.task
        await self.act.close()


async def _live(ckpt: Path, blocks: BlockSet, name: str, ids: list[str]) -> Live:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token=TOKEN, kv_tokens=2048, max_batch_tokens=64,
                       instance=name)
    inst = EngineInstance(cfg, blocks.config, ByteTokenizer(), None)
    for bid in ids:
        inst.add_block(blocks.blocks[bid])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(create_app(inst), log_level="warning", lifespan="on", log_config=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    act = await TcpTransport().listen("127.0.0.1", 0, lambda conn: inst.finisher.handle(conn))
    return Live(inst, server, task, act, sock.getsockname()[1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=4, hidden=64, vocab=512)


@pytest.fixture(scope="module")
def blocks(ckpt: Path) -> BlockSet:
    return pack_checkpoint(ckpt, model="tiny-llama")


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    r = Runtime(OperatorSettings(engine_token=TOKEN, live_layer_seconds=0.01, live_zigzag_batches=5), FakeKube(),
                EngineClient(TOKEN, timeout_s=30), Scraper(), None, OperatorMetrics())
    yield r
    await r.engines.aclose()


def _unsplit(blocks: BlockSet, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return Engine(m).generate_many(prompts, params)


async def _serve(e: Live, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def one(p: list[int]) -> list[int]:
        return [ev.token async for ev in e.inst.serving.tokens(e.inst.serving.submit(p, params))]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _round(rt: Runtime, spec: dict[str, Any], engines: dict[str, Live], dropped: dict[str, str]) -> None:
    """One plan-driver round as drive() runs it: engine statuses over HTTP, then the live hook."""
    statuses: dict[str, dict[str, Any] | None] = {}
    for iid, e in engines.items():
        statuses[iid] = None if iid in dropped else await rt.engines.status(e.pod.endpoint or "")
    await LW.advance(rt, NS, spec, statuses, {i: e.pod for i, e in engines.items()}, dropped)


def _live_annotation(kube: FakeKube, name: str) -> str | None:
    ann: dict[str, str] = kube.pods[(NS, name)]["metadata"].get("annotations") or {}
    return ann.get(L.LIVE)


async def test_operator_forms_reforms_and_stops_a_pipeline_of_real_engines(rt: Runtime, ckpt: Path,
                                                                          blocks: BlockSet) -> None:
    params = SamplingParams(max_tokens=6)
    want = _unsplit(blocks, PROMPTS, params)
    held = {"r1": ["embed", "layer.0", "layer.1"], "r2": ["layer.2"], "r3": [], "r4": []}
    engines = {n: await _live(ckpt, blocks, n, ids) for n, ids in held.items()}
    kube: FakeKube = rt.kube
    for e in engines.values():
        kube.add_pool_pod(NS, e.inst.instance_id, "n0", e.pod.endpoint or "", model="tiny-llama")
    spec = {"plan": {"pipelines": [["r1", "r2", "r3", "r4"]]}, "targets": [{"instance": n} for n in engines],
            "blockOrder": list(_blocks())}
    by_inst = {n: e.pod for n, e in engines.items()}
    r1, r2, r3, r4 = (engines[n].inst for n in ("r1", "r2", "r3", "r4"))
    try:
        # instruct time: every member but the last warms its hop; nothing serves yet
        for n in ("r1", "r2", "r3", "r4"):
            await LW.instructed(rt, NS, spec, n, by_inst[n], by_inst)
        assert (r1.peers.handshakes, r2.peers.handshakes, r3.peers.handshakes, r4.peers.handshakes) == (1, 1, 1, 0)
        assert not r1.cooperate and _live_annotation(kube, "r1") is None

        # nobody holds layer 3 yet: no chain, r1 does not serve
        await _round(rt, spec, engines, {})
        assert r1.pair is None and r2.host.downstream is None and not r1.servable

        # layer 3 and the head land on r3: the pipeline r1 -> r2 -> r3 forms on warmed connections
        for bid in ("layer.3", "head"):
            r3.add_block(blocks.blocks[bid])
        await _round(rt, spec, engines, {})
        assert r1.cooperate == {"peer": by_inst["r2"].act_endpoint, "mode": "besteffort"} and r1.phase is Phase.LIVE
        assert r2.downstream_peer == by_inst["r3"].act_endpoint and r3.host.downstream is None
        assert (r1.peers.handshakes, r2.peers.handshakes) == (1, 1)  # no handshake on the critical path
        assert r1.peers.reused == 1 and r2.peers.reused == 1
        assert _live_annotation(kube, "r1") == "true" and _live_annotation(kube, "r2") is None
        assert await _serve(engines["r1"], PROMPTS, params) == want
        await wait_until(lambda: r3.host.rows_hosted == r2.host.rows_hosted, 5, "every row to go r1->r2->r3")
        assert r2.host.rows_hosted > 0 and r4.host.rows_hosted == 0

        # r4 gets layer 3 and the head as well: the working pipeline is left alone
        for bid in ("layer.3", "head"):
            r4.add_block(blocks.blocks[bid])
        pair = r1.pair
        await _round(rt, spec, engines, {})
        assert r1.pair is pair and r2.downstream_peer == by_inst["r3"].act_endpoint

        # r3 dies and is dropped: r2 re-points to r4 (which holds layer 3 and the head); exact again
        await engines["r3"].close()
        await _round(rt, spec, engines, {"r3": "engine unreachable"})
        assert r2.downstream_peer == by_inst["r4"].act_endpoint and r1.pair is pair
        hosted = r2.host.rows_hosted
        assert await _serve(engines["r1"], PROMPTS, params) == want
        await wait_until(lambda: r4.host.rows_hosted == r2.host.rows_hosted - hosted, 5, "r2's new rows to reach r4")
        assert r2.host.rows_hosted - hosted > 0

        # r2 dies too: nobody else holds layer 2, so r1 stops serving live (routers drop it)
        await engines["r2"].close()
        await _round(rt, spec, engines, {"r3": "engine unreachable", "r2": "engine unreachable"})
        assert not r1.cooperate and r1.pair is None and not r1.servable and r1.phase is Phase.LOADING
        assert _live_annotation(kube, "r1") is None
    finally:
        for n in [n for n in engines if not engines[n].task.done()]:
            await engines[n].close()


async def test_operator_pairs_a_loading_target_with_its_source_under_the_zigzag_setting(
        rt: Runtime, ckpt: Path, blocks: BlockSet) -> None:
    params = SamplingParams(max_tokens=5)
    want = _unsplit(blocks, PROMPTS[:2], params)
    a = await _live(ckpt, blocks, "a", list(blocks.blocks))
    b = await _live(ckpt, blocks, "b", ["embed", "layer.0", "layer.1"])
    kube: FakeKube = rt.kube
    kube.add_pool_pod(NS, "b", "n0", b.pod.endpoint or "", model="tiny-llama")
    spec = {"plan": {"livePairs": [["a", "b"]]}, "blockOrder": list(_blocks()),
            "targets": [{"instance": "b", "predictedSeconds": 0.3}]}
    try:
        await LW.instructed(rt, NS, spec, "b", b.pod, {"a": a.pod, "b": b.pod})
        assert b.inst.cooperate == {"peer": a.pod.act_endpoint, "mode": "zigzag"}
        assert b.inst.pair is not None and b.inst.pair.policy is not None
        setting = b.inst.pair.policy.setting
        assert setting.load_ratio == pytest.approx(0.3 / 6 / 0.01) and setting.batches == 5 and setting.layers == 4
        assert _live_annotation(kube, "b") == "true"
        for bid in ("layer.2", "layer.3"):  # ZigZag may hold an admission until its prefix is resident
            b.inst.add_block(blocks.blocks[bid])
        assert await _serve(b, PROMPTS[:2], params) == want
        assert a.inst.host.rows_hosted > 0
    finally:
        await b.close()
        await a.close()
