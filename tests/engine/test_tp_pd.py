"""Prefill/decode disaggregation with tensor-parallel instances, "gathered at rank 0" (engine/kascade_engine/tp/kv.py):
a TP prefill engine's rank 0 gathers every rank's KV heads of the prompt into the whole-model layout a TP-1 engine
ships; a TP decode engine's rank 0 receives it and scatters every rank its heads. The wire is unchanged, so any
prefill engine feeds any decode engine. Real engine processes (`kascade engine serve --tp N`, gloo), the decode engine
asked with the router's `X-Kascade-Prefill` header; greedy text equals the TP-1 engine's colocated text, and both
engines' /metrics show the KV moved (no local fallback)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kascade_devcluster.localengine import EngineProc
from kascade_engine.tp.shard import TPError, TPLayout
from kascade_planner.engine_api import PREFILL_HEADER

from .conftest import start_engine

H = {"Authorization": "Bearer test-token"}
# a long prompt (several pages of 16, and several 16-token chunks on a prefill engine), short ones, one token
PROMPTS = [list(range(5, 60)), [1, 2, 3], [300, 200, 100, 50, 7, 7, 7, 9], [42], list(range(400, 437))]


def _text(e: EngineProc, prompt: list[int], prefill: EngineProc | None = None) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    headers = {PREFILL_HEADER: f"127.0.0.1:{prefill.act}"} if prefill is not None else {}
    r = httpx.post(e.url + "/v1/completions", json=body, headers=headers, timeout=180)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _texts(d: EngineProc, p: EngineProc | None) -> list[str]:
    """Every prompt at once (the prefill engine batches them: several remote sequences in one step's gather)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda q: _text(d, q, p), PROMPTS))


def _metric(e: EngineProc, name: str, **labels: str) -> float:
    text = httpx.get(e.url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def _kv_bytes(ckpt: Path) -> int:
    """The whole model's K and V of every prompt (fp32): what crosses the wire whatever either engine's tp."""
    cfg = json.loads((ckpt / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return sum(len(p) for p in PROMPTS) * per_token


@pytest.fixture(scope="module")
def engines(tiny_ckpt: Path) -> Iterator[dict[str, EngineProc]]:
    # --max-batch-tokens 16: a prompt's prefill takes several chunks (KV gathered per chunk at chunk offsets)
    common = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "128",
              "--kv-tokens", "4096", "--max-batch-tokens", "16"]
    out: dict[str, EngineProc] = {}
    try:
        for name, tp in (("tp1", 1), ("tp2a", 2), ("tp2b", 2)):
            out[name] = start_engine([*common, "--tp", str(tp)], timeout=300)
        yield out
    finally:
        for e in out.values():
            e.stop()


@pytest.mark.parametrize(("p", "d"), [("tp2a", "tp1"), ("tp1", "tp2a"), ("tp2a", "tp2b")])
def test_tp_prefill_and_decode_serve_the_tp1_text(engines: dict[str, EngineProc], tiny_ckpt: Path, p: str,
                                                  d: str) -> None:
    want = _texts(engines["tp1"], None)  # the TP-1 engine alone: colocated, its own prefill
    P, D = engines[p], engines[d]
    kv = "kascade_kv_transfer_bytes_total"
    served, remote, fallbacks = (_metric(P, "kascade_pd_prefills_served_total"),
                                 _metric(D, "kascade_pd_remote_prefills_total"),
                                 _metric(D, "kascade_pd_local_fallbacks_total"))
    sent, received = _metric(P, kv, direction="sent"), _metric(D, kv, direction="received")
    assert _texts(D, P) == want
    assert _metric(P, "kascade_pd_prefills_served_total") - served == len(PROMPTS)
    assert _metric(D, "kascade_pd_remote_prefills_total") - remote == len(PROMPTS)  # every KV adopted on D
    assert _metric(D, "kascade_pd_local_fallbacks_total") == fallbacks
    # the whole model's KV heads crossed, once: gathered from every rank of a TP prefill engine, not rank 0's alone
    assert _metric(P, kv, direction="sent") - sent == _metric(D, kv, direction="received") - received == \
        _kv_bytes(tiny_ckpt)


def test_tp4_with_replicated_kv_heads_prefills_and_decodes(engines: dict[str, EngineProc], tiny_ckpt: Path) -> None:
    """tp 4 over 2 KV heads: each KV head lives on two ranks; the gather takes it once, the scatter gives it to
    both."""
    tp4 = start_engine(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "128",
                        "--kv-tokens", "4096", "--tp", "4"], timeout=300)
    try:
        want = _texts(engines["tp1"], None)
        assert _texts(engines["tp1"], tp4) == want  # TP-4 prefill -> TP-1 decode
        assert _texts(tp4, engines["tp2a"]) == want  # TP-2 prefill -> TP-4 decode
        assert _metric(tp4, "kascade_pd_prefills_served_total") == len(PROMPTS)
        assert _metric(tp4, "kascade_pd_remote_prefills_total") == len(PROMPTS)
        assert _metric(tp4, "kascade_pd_local_fallbacks_total") == 0
    finally:
        tp4.stop()


def test_a_tp_prefill_engine_that_loses_a_rank_exits_and_its_prompts_are_prefilled_on_the_decoder(
        engines: dict[str, EngineProc], tiny_ckpt: Path) -> None:
    """A follower of a TP-2 prefill engine dies: the engine exits 3 (no KV from half a model), and the decode engine
    that names it prefills the prompt itself, with the same text (PD never fails a request)."""
    p = start_engine(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "128",
                      "--kv-tokens", "4096", "--tp", "2"], timeout=300)
    try:
        d = engines["tp1"]
        want = _text(d, PROMPTS[0])
        assert _text(d, PROMPTS[0], p) == want  # served by P first
        kids = Path(f"/proc/{p.proc.pid}/task/{p.proc.pid}/children").read_text().split()
        assert len(kids) == 1, kids  # its follower rank
        os.kill(int(kids[0]), signal.SIGKILL)
        assert p.proc.wait(60) == 3
        fallbacks = _metric(d, "kascade_pd_local_fallbacks_total")
        assert _text(d, PROMPTS[0], p) == want
        assert _metric(d, "kascade_pd_local_fallbacks_total") == fallbacks + 1
    finally:
        p.stop()


def test_tp_engines_take_pd_roles_and_conversion(engines: dict[str, EngineProc]) -> None:
    """bind with role prefill/decode and convert are accepted by a TP instance now; a converted TP decoder keeps
    serving the same text. Live cooperation is accepted too (test_tp_live.py): a dead peer is refused naming `peer`."""
    e = engines["tp2b"]
    want = _text(engines["tp1"], PROMPTS[0])
    ok = httpx.post(e.url + "/kascade/v1/convert", json={"prefillChunkTokens": 8, "stepBudgetMs": 500}, headers=H)
    assert ok.status_code == 200, ok.text
    assert ok.json()["prefillChunkTokens"] == 8
    try:
        assert _text(e, PROMPTS[0]) == want
    finally:
        httpx.post(e.url + "/kascade/v1/convert", json={"prefillChunkTokens": None}, headers=H)
    no = httpx.post(e.url + "/kascade/v1/cooperate", json={"peer": "127.0.0.1:1", "mode": "standby"}, headers=H)
    assert no.status_code == 502 and '"peer"' in no.text, no.text
    ok = httpx.post(e.url + "/kascade/v1/bind", json={"model": "tiny-llama", "modelService": "svc", "role": "decode"},
                    headers=H)
    assert ok.status_code == 200 and ok.json()["role"] == "decode", ok.text
    assert _text(e, PROMPTS[0], engines["tp2a"]) == want


@pytest.mark.parametrize(("tp", "kv"), [(2, 2), (4, 2), (2, 4), (4, 4)])
def test_whole_kv_puts_every_ranks_heads_in_model_order(tp: int, kv: int) -> None:
    layout = TPLayout.of({"num_attention_heads": 4, "num_key_value_heads": kv, "intermediate_size": 128,
                          "hidden_size": 64}, tp)
    whole = torch.randn(2, 3, 5, kv, 16)  # [k/v, layers, positions, kv heads, head dim]
    per_rank = [layout.kv_of(r, whole).clone() for r in range(tp)]
    assert all(t.shape[-2] == layout.local_kv_heads for t in per_rank)
    assert torch.equal(layout.whole_kv(per_rank), whole)
    if tp > kv:  # replicated: ranks sharing a KV head hold the same one
        assert torch.equal(per_rank[0], per_rank[1])
    with pytest.raises(TPError, match="tp: 1 ranks' KV"):
        layout.whole_kv(per_rank[:1])
