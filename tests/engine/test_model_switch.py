"""A released engine changes model (issue 35: a GPU of the shared pool serves another model): bind with
`modelPath` switches an engine holding no weights to that model's config and tokenizer, then it loads and
serves the new model; an engine holding weights or bound refuses, and a bad path is refused by field name."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
