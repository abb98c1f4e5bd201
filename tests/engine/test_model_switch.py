"""A released engine changes model (issue 35: a GPU of the shared pool serves another model): bind with
`modelPath` switches an engine holding no weights to that model's config and tokenizer, then it loads and
serves the new model; an engine holding weights or bound refuses, and a bad path is refused by field name. A
switched engine's Prometheus series carry the new model's name (a real engine process's /metrics)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import ByteTokenizer
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.engine_api import BindRequest, Phase, WireError


async def _serving(inst: EngineInstance) -> None:
    for _ in range(500):
        if inst.phase is Phase.SERVING or inst.load_error:
            break
        await asyncio.sleep(0.01)
    assert inst.phase is Phase.SERVING, (inst.phase, inst.load_error)


async def test_a_released_engine_of_one_model_binds_and_serves_another(tiny_ckpt: Path, tiny_blocks,
                                                                        tmp_path: Path) -> None:
    other = tiny_llama(tmp_path / "other", layers=3, hidden=96, vocab=384, seed=7)
    inst = EngineInstance(EngineConfig(tiny_ckpt, "tiny-llama", "tok", device="cpu", empty=True,
                                       host_cache_bytes=1 << 30), tiny_blocks.config, ByteTokenizer())
    inst.serving.start()
    try:
        await inst.bind(BindRequest("tiny-llama", "b", source_path=str(tiny_ckpt)))
        await _serving(inst)
        with pytest.raises(InstanceError, match="release it first"):  # bound, holding B's weights
            await inst.bind(BindRequest("other", "b", model_path=str(other)))
        inst.drain()
        assert inst.release().host_copy_bytes > 0  # B's weights kept in host memory
        with pytest.raises(InstanceError, match="modelPath") as e:
            await inst.bind(BindRequest("other", "a", model_path=str(tmp_path / "missing")))
        assert e.value.field == "modelPath" and inst.config.model_name == "tiny-llama"
        with pytest.raises(InstanceError, match="holds 'tiny-llama'"):  # no path: refused as before
            await inst.bind(BindRequest("other", "a"))
        st = await inst.bind(BindRequest("other", "a", source_path=str(other), model_path=str(other)))
        assert (st.model, st.model_service) == ("other", "a") and st.host_copy_bytes == 0  # B's copy went
        await _serving(inst)
        assert inst.model.shape.layers == 3 and inst.status().ready
        rid = inst.serving.submit([1, 2, 3], SamplingParams(max_tokens=4))
        assert len([ev async for ev in inst.serving.tokens(rid)]) == 4
    finally:
        await inst.close()


def test_model_path_on_the_wire() -> None:
    req = BindRequest("m", "svc", model_path="/models/m")
    assert req.to_dict()["modelPath"] == "/models/m" and BindRequest.from_dict(req.to_dict()) == req
    with pytest.raises(WireError, match="modelPath"):
        BindRequest.from_dict({"model": "m", "modelService": "svc", "modelPath": 3})


def _series(text: str, model: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r'^(kascade_\w+)\{[^}]*model_name="' + re.escape(model) + '"', text, re.M)}


def test_a_switched_engine_reports_its_metrics_under_the_new_model_name(tiny_ckpt: Path, tmp_path: Path,
                                                                          engine_starter) -> None:
    other = tiny_llama(tmp_path / "other", layers=3, hidden=96, vocab=384, seed=7)
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    h = {"Authorization": f"Bearer {e.token}"}

    def serving_and_one_request(model: str) -> None:
        deadline = time.monotonic() + 120
        while httpx.get(e.url + "/kascade/v1/status", headers=h, timeout=30).json()["phase"] != "serving":
            assert time.monotonic() < deadline, f"{model} never served"
            time.sleep(0.1)
        r = httpx.post(e.url + "/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text

    try:
        bind = {"model": "tiny-llama", "modelService": "b", "role": "colocated", "source": {"path": str(tiny_ckpt)}}
        assert httpx.post(e.url + "/kascade/v1/bind", json=bind, headers=h, timeout=60).status_code == 200
        serving_and_one_request("tiny-llama")
        before = httpx.get(e.url + "/metrics", timeout=30).text
        old = _series(before, "tiny-llama")
        assert "kascade_requests_arrived_total" in old and "kascade_time_to_first_token_seconds_bucket" in old
        assert "kascade_decode_velocity_tokens_per_second" in old and "kascade_pd_prefills_served_total" in old
        assert httpx.post(e.url + "/kascade/v1/drain", headers=h, timeout=30).status_code == 200
        assert httpx.post(e.url + "/kascade/v1/release", headers=h, timeout=30).status_code == 200
        bind = {"model": "other", "modelService": "a", "role": "colocated", "source": {"path": str(other)},
                "modelPath": str(other)}
        r = httpx.post(e.url + "/kascade/v1/bind", json=bind, headers=h, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "other", r.text
        serving_and_one_request("other")
        after = httpx.get(e.url + "/metrics", timeout=30).text
        assert not _series(after, "tiny-llama"), [x for x in after.splitlines() if "tiny-llama" in x][:5]
        assert old <= _series(after, "other")  # every series moved to the new name
        # one engine's counters stay monotonic across the switch: both requests count, under the new name
        arrived = re.search(r'^kascade_requests_arrived_total\{model_name="other"\} (\S+)$', after, re.M)
        assert arrived and float(arrived.group(1)) == 2.0, arrived
    finally:
        e.stop()
