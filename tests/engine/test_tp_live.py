"""Live pairing with tensor-parallel instances (docs/tp.md, "Live pairing: activations at rank 0, KV per rank"): a
loading engine B (embed + 2 of the tiny Llama's 4 layers resident, `--resident-layers 2`) paired with a full engine A
by `cooperate`. Either side may be TP-2: the activations cross between the two rank 0s, and every rank runs the rows'
layer ranges (`Layers` messages, tp/leader.py `run_rows`) on its own heads and its own share of the pair's private KV
pages. Real engine processes (`kascade engine serve --tp N`, gloo); greedy text equals the TP-1 engine's, for B's
requests (split) and A's own requests sent at the same time (sharing A's forwards with B's rows). A rank dying fails
its instance (exit 3): B's requests out on a dead A fail with an error naming the pair, and B pairs again; a dead B
leaves A serving."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from splitref import collect, unsplit

from kascade_devcluster.localengine import EngineProc
from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Limits
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import CooperateRequest

from .conftest import start_engine

H = {"Authorization": "Bearer test-token"}
# a long prompt (several 16-token chunks), short ones, one token
PROMPTS = [list(range(5, 45)), [1, 2, 3], [300, 200, 100, 50, 7, 7, 7, 9], [42], list(range(400, 421))]
COMMON = ["--model-name", "tiny-llama", "--max-prompt-tokens", "128", "--kv-tokens", "4096",
          "--max-batch-tokens", "16"]


def _ask(e: EngineProc, prompt: list[int], max_tokens: int = 10) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(e.url + "/v1/completions", json=body, timeout=300)


def _text(e: EngineProc, prompt: list[int]) -> str:
    r = _ask(e, prompt)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _texts(*engines: EngineProc) -> list[list[str]]:
    """Every prompt at every engine, all at once (B's split rows and A's own rows share A's forwards)."""
    with ThreadPoolExecutor(len(PROMPTS) * len(engines)) as pool:
        futs = [[pool.submit(_text, e, q) for q in PROMPTS] for e in engines]
        return [[f.result() for f in fs] for fs in futs]


def _metric(e: EngineProc, name: str) -> float:
    text = httpx.get(e.url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def _cooperate(b: EngineProc, a: EngineProc | None, mode: str = "besteffort") -> httpx.Response:
    peer = f"127.0.0.1:{a.act}" if a is not None else ""
    return httpx.post(b.url + "/kascade/v1/cooperate", json={"peer": peer, "mode": mode if a else "off"},
                      headers=H, timeout=60)


def _follower(e: EngineProc) -> int:
    kids = Path(f"/proc/{e.proc.pid}/task/{e.proc.pid}/children").read_text().split()
    assert len(kids) == 1, kids  # its one follower rank
    return int(kids[0])


@pytest.fixture(scope="module")
def engines(tiny_ckpt: Path) -> Iterator[dict[str, EngineProc]]:
    out: dict[str, EngineProc] = {}
    try:
        for name, tp, resident in (("tp1", 1, None), ("tp2", 2, None), ("b1", 1, 2), ("b2", 2, 2)):
            out[name] = start_engine(["--checkpoint", str(tiny_ckpt), *COMMON, "--tp", str(tp),
                                      *(["--resident-layers", str(resident)] if resident else [])], timeout=300)
        yield out
    finally:
        for e in out.values():
            e.stop()


@pytest.mark.parametrize(("b", "a", "mode"), [("b2", "tp1", "besteffort"), ("b1", "tp2", "besteffort"),
                                              ("b2", "tp2", "besteffort"), ("b2", "tp2", "zigzag")])
def test_live_pair_with_tp_instances_serves_the_tp1_text(engines: dict[str, EngineProc], b: str, a: str,
                                                         mode: str) -> None:
    want = _texts(engines["tp1"])[0]  # the TP-1 engine alone
    assert len({t for t in want}) > 2  # a degenerate model would make the comparison meaningless
    B, A = engines[b], engines[a]
    alone = _ask(B, PROMPTS[1])
    assert alone.status_code == 503 and "2/4 layers resident" in alone.text, alone.text  # B cannot serve alone
    r = _cooperate(B, A, mode)
    assert r.status_code == 200 and r.json()["cooperate"]["mode"] == mode, r.text
    try:
        split = _metric(B, "kascade_live_split_requests_total")
        got_b, got_a = _texts(B, A)
        assert got_b == want  # B's requests: layers 0-1 on B's ranks, 2-3 on A's, sampled on A's rank 0
        assert got_a == want  # A's own requests, in the same forwards as B's rows
        assert _metric(B, "kascade_live_split_requests_total") == split + len(PROMPTS)
    finally:
        assert _cooperate(B, None).status_code == 200


def _stream_until_killed(b: EngineProc, victim: EngineProc) -> tuple[list[str], str | Exception]:
    """Stream a long greedy request from B; after its first tokens, SIGKILL `victim`'s follower rank (the request is
    out on the pair then) and wait for `victim` to exit 3. Returns the tokens' text before the kill and what the rest
    of the stream said (its body, or the error reading it)."""
    body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
    before: list[str] = []
    with httpx.stream("POST", b.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                before.append(line)
                if len(before) == 3:
                    break
        os.kill(_follower(victim), signal.SIGKILL)
        assert victim.proc.wait(60) == 3  # the instance failed: no token from half a model
        try:
            rest: str | Exception = "\n".join(lines)
        except httpx.HTTPError as e:
            rest = e
    return before, rest


def test_a_tp_peer_that_loses_a_rank_exits_and_the_pairs_requests_fail_naming_it(
        engines: dict[str, EngineProc], tiny_ckpt: Path) -> None:
    """The serving peer A is TP-2 and its follower dies mid-request: A exits 3; the pair's request on B fails with
    an error naming the pair (B cannot finish it: its KV of layers 2-3 was on A's ranks) instead of finishing, B stays
    up and pairs with another peer, and serves the same text again."""
    A = start_engine(["--checkpoint", str(tiny_ckpt), *COMMON, "--tp", "2"], timeout=300)
    B = engines["b1"]
    try:
        want = _text(engines["tp1"], PROMPTS[0])
        assert _cooperate(B, A).status_code == 200
        assert _text(B, PROMPTS[0]) == want
        before, rest = _stream_until_killed(B, A)
        assert len(before) == 3
        assert isinstance(rest, str) and "pair" in rest and "error" in rest, rest  # failed, naming the pair
        assert '"finish_reason":"length"' not in rest.replace(" ", ""), rest  # not finished as if nothing happened
        assert _cooperate(B, engines["tp2"]).status_code == 200  # B pairs again (another TP-2 peer)
        assert _text(B, PROMPTS[0]) == want
    finally:
        _cooperate(B, None)
        A.stop()


def test_a_tp_loading_engine_that_loses_a_rank_exits_and_its_peer_serves_on(
        engines: dict[str, EngineProc], tiny_ckpt: Path) -> None:
    """The loading engine B is TP-2 and its follower dies mid-request: B exits 3 and its client's stream breaks (no
    answer from half a model); A's pair session ends and A (TP-2) keeps serving its own requests with the same
    text."""
    B = start_engine(["--checkpoint", str(tiny_ckpt), *COMMON, "--tp", "2", "--resident-layers", "2"], timeout=300)
    A = engines["tp2"]
    try:
        want = _texts(engines["tp1"])[0]
        assert _cooperate(B, A).status_code == 200
        assert _text(B, PROMPTS[0]) == want[0]
        before, rest = _stream_until_killed(B, B)
        assert len(before) == 3
        assert isinstance(rest, Exception) or '"finish_reason":"length"' not in rest.replace(" ", ""), rest
        assert _texts(A)[0] == want
    finally:
        B.stop()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40),
                                    SamplingParams(max_tokens=40, temperature=0.9, seed=11)], ids=["greedy", "seeded"])
async def test_split_sequences_migrate_from_a_tp_peer(engines: dict[str, EngineProc], tiny_ckpt: Path,
                                                      tiny_blocks: Any, params: SamplingParams) -> None:
    """Decode-state migration off a TP-2 serving peer: B (in this process, 1 layer resident) runs split with the TP-2
    engine, then its last blocks land; A's rank 0 gathers every rank's heads of the sequences' layers 1-3
    (`TPEngine.read_kv`, migration.take_from) and B finishes them alone; outputs equal the unsplit engine's."""
    want = unsplit(tiny_blocks, PROMPTS[:3], params)
    cfg = EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token="test-token", kv_tokens=2048,
                       max_batch_tokens=64, instance="b", resident_layers=1)
    b = EngineInstance(cfg, tiny_blocks.config, ByteTokenizer(), tiny_blocks)
    b.serving.start()
    try:
        await b.set_cooperate(CooperateRequest(f"127.0.0.1:{engines['tp2'].act}", "besteffort"))
        rids = [b.serving.submit(pr, params) for pr in PROMPTS[:3]]
        runs = [asyncio.create_task(collect(b, r)) for r in rids]
        pc = b.pair
        assert pc is not None
        while pc.steps_sent < 5:  # a few tokens generated split
            await asyncio.sleep(0.005)
        for i in (1, 2, 3):
            b.add_block(tiny_blocks.blocks[f"layer.{i}"])
        b.add_block(tiny_blocks.blocks["head"])
        out = await asyncio.wait_for(asyncio.gather(*runs), 300)
        assert out == want
        assert pc.migrated == 3  # every split sequence moved off the TP peer
        assert pc.steps_sent < 5 + params.max_tokens  # the rest of the decode ran on B alone
    finally:
        await b.close()


def test_migration_through_read_kv_and_write_kv_equals_the_cache_path(tiny_blocks: Any) -> None:
    """migration.take_from / put_into on an engine whose KV is split over ranks (tp > 1) go through `read_kv` /
    `write_kv` (a TP engine's gather at / scatter from rank 0); the bytes and the slots written equal the direct
    cache path's, and layers below k are kept."""
    from kascade_engine.live import migration

    class Split(Engine):  # read_kv / write_kv over the whole cache, as a TP engine's rank 0 sees them
        tp = 2

    m = LlamaModel(tiny_blocks.config)
    src, dst = Split(m, Limits(kv_tokens=64, page_size=4)), Split(m, Limits(kv_tokens=64, page_size=4))
    src.cache.k.normal_()
    src.cache.v.normal_()
    dst.cache.k.normal_()
    dst.cache.v.normal_()
    before = dst.cache.k.clone()
    L = m.shape.layers
    payload = migration.take_from(src, [3, 5], 1, 6)
    assert payload == migration.take(src.cache, [3, 5], 1, 6)
    assert len(payload) == migration.engine_kv_bytes(src, L - 1, 6) == migration.kv_bytes(src.cache, L - 1, 6)
    migration.put_into(dst, [6, 2], 1, 6, memoryview(payload))
    here, there = torch.tensor([24, 25, 26, 27, 8, 9]), torch.tensor([12, 13, 14, 15, 20, 21])
    for layer in range(1, L):
        assert torch.equal(dst.cache.k[layer][here], src.cache.k[layer][there])
        assert torch.equal(dst.cache.v[layer][here], src.cache.v[layer][there])
    assert torch.equal(dst.cache.k[0], before[0])  # layer 0 (B's own) untouched
    with pytest.raises(ValueError, match="bytes"):
        migration.put_into(dst, [6, 2], 1, 5, memoryview(payload))
