"""EngineInstance in-process: the phase walk of a warm-pool engine (empty -> bound -> loading -> serving
-> draining -> released -> bound again), dtype from bind, and the shared control-API wire types
refusing bad bodies by field name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import ConfigError, EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import ByteTokenizer
from kascade_planner.engine_api import BindRequest, CooperateRequest, EngineStatus, LoadPlanRequest, Phase, WireError


def _empty(ckpt: Path, blocks, **kw) -> EngineInstance:
    cfg = EngineConfig(ckpt, "tiny-llama", "tok", device="cpu", empty=True, **kw)
    return EngineInstance(cfg, blocks.config, ByteTokenizer())


async def _wait(inst: EngineInstance, phase: Phase) -> None:
    for _ in range(500):
        if inst.phase is phase or inst.load_error:
            break
        await asyncio.sleep(0.01)
    assert inst.phase is phase, (inst.phase, inst.load_error)


async def test_phase_walk_bind_source_serve_drain_release(tiny_ckpt, tiny_blocks) -> None:
    inst = _empty(tiny_ckpt, tiny_blocks)
    inst.serving.start()
    try:
        assert inst.phase is Phase.EMPTY and not inst.ready
        with pytest.raises(InstanceError, match="engine is empty"):
            inst.accepting()
        st = await inst.bind(BindRequest("tiny-llama", "svc", "colocated"))
        assert st.phase == "bound" and st.model_service == "svc"
        with pytest.raises(InstanceError, match="bound to 'svc'"):
            await inst.bind(BindRequest("tiny-llama", "other"))
        with pytest.raises(InstanceError, match="holds 'tiny-llama'"):
            await inst.bind(BindRequest("nope", "svc"))
        st = await inst.load_source(str(tiny_ckpt))
        assert st.phase in ("loading", "serving")
        await _wait(inst, Phase.SERVING)
        assert inst.status().ready and inst.status().bytes_received == tiny_blocks.total_bytes
        rid = inst.serving.submit([1, 2, 3], SamplingParams(max_tokens=3))
        toks = [ev.token async for ev in inst.serving.tokens(rid)]
        assert len(toks) == 3
        assert inst.drain().phase == "draining"
        with pytest.raises(InstanceError, match="draining"):
            inst.accepting()
        st = inst.release()
        assert st.phase == "released" and not any(st.blocks.values()) and inst.blockset is None
        assert (await inst.bind(BindRequest("tiny-llama", "svc2"))).phase == "bound"
    finally:
        await inst.close()


async def test_bind_sets_dtype_before_weights_and_refuses_after(tiny_ckpt, tiny_blocks) -> None:
    inst = _empty(tiny_ckpt, tiny_blocks)
    inst.serving.start()
    st = await inst.bind(BindRequest("tiny-llama", "svc", dtype="bfloat16"))
    assert st.dtype == "bfloat16" and inst.model.dtype is not None and str(inst.model.dtype) == "torch.bfloat16"
    inst.add_blockset(tiny_blocks)
    assert inst.model.weights["layer.0"]["self_attn.q_proj.weight"].dtype == inst.model.dtype
    rid = inst.serving.submit([1, 2, 3], SamplingParams(max_tokens=3))  # the running loop steps the new engine
    assert len([ev async for ev in inst.serving.tokens(rid)]) == 3
    assert inst.engine.cache.k.dtype == inst.model.dtype
    with pytest.raises(InstanceError, match="cannot switch to float32"):
        await inst.bind(BindRequest("tiny-llama", "svc", dtype="float32"))
    await inst.close()


def test_config_refuses_bad_values(tiny_ckpt) -> None:
    with pytest.raises(ConfigError, match="--device 'gpu'"):
        EngineConfig(tiny_ckpt, "m", "t", device="gpu")
    with pytest.raises(ConfigError, match="--dtype 'fp8'"):
        EngineConfig(tiny_ckpt, "m", "t", dtype="fp8")
    with pytest.raises(ConfigError, match="--page-size must be >= 1"):
        EngineConfig(tiny_ckpt, "m", "t", page_size=0)
    with pytest.raises(ConfigError, match="no control token"):
        EngineConfig(tiny_ckpt, "m", "")


@pytest.mark.parametrize(("kind", "doc", "field"), [
    (BindRequest, {"model": "m", "modelService": "s"}, "role"),
    (BindRequest, {"model": "m", "modelService": "s", "role": "boss"}, "role"),
    (BindRequest, {"model": "m", "modelService": "s", "role": "decode", "source": {"path": ""}}, "source.path"),
    (BindRequest, {"model": "m", "modelService": "s", "role": "decode", "source": {"uri": "x"}}, "source.uri"),
    (BindRequest, {"model": "m", "modelService": "s", "role": "decode", "dtype": "int4"}, "dtype"),
    (BindRequest, [1, 2], "body"),
    (LoadPlanRequest, {"self": "a", "peers": {}, "planToken": "t"}, "plan"),
    (LoadPlanRequest, {"plan": {}, "self": "a", "peers": {"a": 5}, "planToken": "t"}, "peers.a"),
    (LoadPlanRequest, {"plan": {}, "self": "a", "peers": {}, "planToken": "t", "chunkBytes": 0}, "chunkBytes"),
    (LoadPlanRequest, {"plan": {}, "self": "a", "peers": {}, "planToken": ""}, "planToken"),
    (CooperateRequest, {"peer": "h:1", "mode": "sideways"}, "mode"),
    (CooperateRequest, {"peer": "h:1", "mode": "off", "extra": 1}, "extra"),
])
def test_wire_types_name_the_bad_field(kind, doc, field: str) -> None:
    with pytest.raises(WireError) as e:
        kind.from_dict(doc)
    assert e.value.field == field and f"'{field}'" in str(e.value)


def test_wire_types_round_trip() -> None:
    b = BindRequest("m", "s", "decode", "/ckpt", "float16")
    assert BindRequest.from_dict(b.to_dict()) == b
    lp = LoadPlanRequest({"algorithm": "star"}, "a", {"a": "h:1"}, "tok", {"embed": {}}, 4096, 3.0)
    assert LoadPlanRequest.from_dict(lp.to_dict()) == lp
    c = CooperateRequest("h:2", "zigzag")
    assert CooperateRequest.from_dict(c.to_dict()) == c
    s = EngineStatus("e", "m", Phase.SERVING, "colocated", "svc", {"embed": True}, 10, True, None, None, "cpu",
                     "float32")
    assert EngineStatus.from_dict(s.to_dict()) == s


def test_prompts_up_to_the_models_context_and_kv_capacity_resolved(tiny_ckpt: Path, tiny_blocks) -> None:
    """By default a prompt may fill the model's context (max_position_embeddings) and the CPU's KV holds 65,536
    tokens; flags given win; a negative one is refused by name."""
    from kascade_engine.config import CPU_KV_TOKENS

    inst = _empty(tiny_ckpt, tiny_blocks)
    assert inst.config.max_prompt_tokens == tiny_blocks.config["max_position_embeddings"]
    assert inst.config.kv_tokens == CPU_KV_TOKENS
    inst = _empty(tiny_ckpt, tiny_blocks, max_prompt_tokens=64, kv_tokens=2048)
    assert (inst.config.max_prompt_tokens, inst.config.kv_tokens) == (64, 2048)
    with pytest.raises(ConfigError, match="--kv-tokens"):
        EngineConfig(tiny_ckpt, "m", "t", kv_tokens=-1)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineConfig(tiny_ckpt, "m", "t", gpu_memory_utilization=1.5)


def test_kv_tokens_from_device_memory() -> None:
    """CUDA sizing (kvcache.kv_tokens_for_memory): the utilization share of the device minus what others hold and
    the weights, in whole pages; never more than is free; nothing left is a clear error."""
    from kascade_engine.batch.kvcache import kv_tokens_for_memory

    gib = 1 << 30
    # 80 GiB device, 78 free, 90 %: 72 GiB - 2 used by others - 16 weights = 54 GiB of KV at 128 KiB a token
    assert kv_tokens_for_memory(78 * gib, 80 * gib, 0.9, 16 * gib, 128 << 10, 16) == 54 * gib // (128 << 10)
    # the share is larger than what is free: only the free memory counts
    assert kv_tokens_for_memory(10 * gib, 80 * gib, 1.0, 2 * gib, 1 << 20, 16) == 8 * 1024
    assert kv_tokens_for_memory(gib, gib, 0.5, 0, 1000, 16) % 16 == 0
    with pytest.raises(ValueError, match="no KV cache"):
        kv_tokens_for_memory(10 * gib, 80 * gib, 0.9, 20 * gib, 1 << 20, 16)


def test_a_status_with_an_unknown_phase_is_refused_naming_the_field() -> None:
    doc = EngineStatus("e", "m", Phase.SERVING, "colocated", None, {}, 0, True).to_dict()
    assert doc["phase"] == "serving"
    with pytest.raises(ValueError, match=r"phase: 'ready' is not an engine phase \(empty, bound, loading"):
        EngineStatus.from_dict({**doc, "phase": "ready"})
