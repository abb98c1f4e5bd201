"""Measured velocities: the meter's arithmetic on known step timings (the prefill velocity is the capacity of
saturated steps, the best unsaturated step before any), a real engine's /metrics after it served prompts of two
lengths (floors > 0 in the buckets it saw, 0 elsewhere), and a real engine on an emulated accelerator whose
reported velocity is its saturated throughput after a light load and a burst."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.velocity import VelocityMeter, bucket
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.tokenizer import ByteTokenizer


def test_meter_buckets_and_splits_mixed_steps() -> None:
    m = VelocityMeter()
    assert m.prefill_velocity(100) is None and m.decode_capacity() is None and m.prefill_capacity() is None
    m.observe([(100, 100)], 0, 0.5, saturated=True)  # prefill only, full: 200 tok/s in bucket 128
    assert m.prefill == {"128": 200.0}
    m.observe([], 4, 0.1, saturated=False)  # decode only: 40 tok/s at batch <= 4
    assert m.decode == {"4": 40.0}
    m.observe([(300, 300)], 4, 1.1, saturated=True)  # mixed: 4 decodes cost 0.1 s (40 tok/s) -> 300 tokens in 1.0 s
    assert m.prefill["512"] == pytest.approx(300.0)
    m.observe([(10, 10)], 10, 0.2, saturated=True)  # decodes of an unmeasured batch bucket (16): cannot be split
    assert "128" in m.prefill and m.prefill["128"] == 200.0
    m.observe([(100, 100)], 0, 0.25, saturated=True)  # EWMA: 0.8 * 200 + 0.2 * 400
    assert m.prefill["128"] == pytest.approx(240.0)
    assert m.prefill_velocity(1000) == m.prefill["512"]  # nearest measured bucket
    assert m.decode_capacity() == 40.0
    assert (bucket(128, (128, 512)), bucket(129, (128, 512)), bucket(9999, (128, 512))) == ("128", "512", "inf")


def test_the_prefill_velocity_is_the_capacity_of_saturated_steps() -> None:
    """An emulated accelerator (bench/pd.py --emulate-layer-ms 30: every step 240 ms up to the 117-token budget):
    short background prompts alone in a step read 67-200 tok/s, a burst's full steps 487.5 tok/s. Only the full
    (saturated) steps are the capacity; before the first one the velocity is the best unsaturated step (a lower
    bound, never scaled up to a full step); mixed steps that are not full count for nothing. The old meter took
    every step into its bucket's EWMA and the operator the min over buckets: 128-ish, ~4x under."""
    m = VelocityMeter()
    for tokens in (16, 32, 48, 24, 40):  # background: one prompt alone in a 240 ms step, the budget not reached
        m.observe([(tokens, tokens)], 0, 0.24, saturated=False)
    assert m.prefill == {} and m.prefill_floor == {"128": pytest.approx(200.0)}
    assert m.prefill_capacity() == pytest.approx(200.0)  # the best delivered, not 48 tokens scaled to 117
    m.observe([(20, 20)], 3, 0.24, saturated=False)  # mixed, not full: no floor from an estimated split
    assert m.prefill_floor == {"128": pytest.approx(200.0)}
    for _ in range(6):  # the burst: 117-token chunks of 366-token prompts, more waiting
        m.observe([(117, 366)], 0, 0.24, saturated=True)
    assert m.prefill == {"512": pytest.approx(487.5)}
    assert m.prefill_capacity() == pytest.approx(487.5)  # a bucket with a capacity: the floors are out
    m.observe([(15, 366), (40, 40)], 0, 0.24, saturated=False)  # the burst's last chunk, nothing behind it
    m.observe([(30, 30)], 0, 0.24, saturated=False)
    assert m.prefill_capacity() == pytest.approx(487.5)
    # the CPU: step time linear in tokens plus an intercept (8 ms + 0.4 ms a token, 512-token budget)
    cpu = VelocityMeter()
    for tokens in (16, 48, 420):
        cpu.observe([(tokens, tokens)], 0, 0.008 + 0.0004 * tokens, saturated=False)
    floor = cpu.prefill_capacity()
    assert floor == pytest.approx(420 / 0.176)  # the 420-token prompt alone: 2386 tok/s, a lower bound
    cpu.observe([(512, 420)], 0, 0.008 + 0.0004 * 512, saturated=True)
    assert cpu.prefill_capacity() == pytest.approx(512 / 0.2128)  # 2406 tok/s: the capacity, just above the floor
    cpu.observe([(512, 100)], 0, 0.008 + 0.0004 * 512, saturated=True)  # short prompts packed: bucket 128 too
    assert cpu.prefill_capacity() == pytest.approx(512 / 0.2128)  # min over saturated buckets


async def test_engine_reports_measured_velocities(tiny_ckpt, tiny_blocks) -> None:
    cfg = EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token="t", kv_tokens=2048, instance="v")
    inst = EngineInstance(cfg, tiny_blocks.config, ByteTokenizer(), tiny_blocks)
    inst.serving.start()
    try:
        async def run(prompt: list[int]) -> None:
            rid = inst.serving.submit(prompt, SamplingParams(max_tokens=4))
            async for _ in inst.serving.tokens(rid):
                pass

        for p in ([1, 2, 3] * 10, list(range(300))):
            await asyncio.wait_for(run(p), 60)
        text = generate_latest(inst.metrics.registry).decode()
    finally:
        await inst.close()
    got = {(s.name, s.labels.get("bucket") or s.labels.get("batch")): s.value
           for f in text_string_to_metric_families(text) for s in f.samples if "velocity" in s.name}
    # each prompt alone, well under the 512-token budget: no saturated step, so no capacity yet, only floors
    assert got[("kascade_prefill_velocity_floor_tokens_per_second", "128")] > 0  # the 30-token prompt
    assert got[("kascade_prefill_velocity_floor_tokens_per_second", "512")] > 0  # the 300-token prompt
    assert got[("kascade_prefill_velocity_floor_tokens_per_second", "2048")] == 0  # never seen
    assert all(got[("kascade_prefill_velocity_tokens_per_second", b)] == 0 for b in ("128", "512", "2048", "inf"))
    assert got[("kascade_decode_velocity_tokens_per_second", "1")] > 0  # one sequence decoding at a time
    assert got[("kascade_decode_velocity_tokens_per_second", "64")] == 0


def test_the_prefill_rate_counts_the_steps_that_gave_waiting_prompts_nothing() -> None:
    """The rate a converted decoder achieves: prompt tokens per step second over the steps taken while prompts
    waited, a step that gave them 0 tokens included (its step budget was full). 16 tokens in a 40 ms step, then
    three 40 ms steps with none: 100 tok/s, where the mixed-step velocity (16 tokens over the step's prefill
    share) says 400 or more. None until RATE_STEPS steps; reset forgets it."""
    from kascade_planner.prefillrate import RATE_STEPS

    m = VelocityMeter()
    for i, tokens in enumerate((16, 0, 0, 0) * 5):
        assert (m.prefill_rate() is None) == (i < RATE_STEPS)
        m.observe_rate(tokens, 0.04)
    rate = m.prefill_rate()
    assert rate is not None and 60 < rate < 160  # an EWMA around 100 (its phase in the 16-0-0-0 cycle)
    m.reset_rate()
    assert m.prefill_rate() is None
    for _ in range(RATE_STEPS):
        m.observe_rate(32, 0.1)
    assert m.prefill_rate() == pytest.approx(320.0)
    m.observe_rate(-1, 0.1)  # garbage: ignored
    m.observe_rate(5, 0.0)
    assert m.prefill_rate() == pytest.approx(320.0)


async def test_a_converted_decoder_measures_its_prefill_rate_between_prompts(tiny_ckpt, tiny_blocks) -> None:
    """A converted decoder with decodes and no prompt waiting still measures the rate a prompt would get: its
    budgets' room beside each step's decodes (here the 4-token cap) over the step's time. So the router's view
    follows its batch between prompts instead of keeping the rate of its last prompt. Not converted, or with
    no step, nothing is measured; a new budget forgets the rate, and the cap's room is measured again."""
    from kascade_planner.engine_api import ConvertRequest

    cfg = EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token="t", kv_tokens=2048, instance="r")
    inst = EngineInstance(cfg, tiny_blocks.config, ByteTokenizer(), tiny_blocks)
    inst.serving.start()
    meter = inst.engine.meter
    try:
        streams = [inst.serving.submit([5 + i, 6, 7], SamplingParams(max_tokens=400)) for i in range(2)]
        while not all(inst.engine.requests.get(r) and inst.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert meter.prefill_rate() is None  # decoding, not converted: no prompt ever waited
        inst.convert(ConvertRequest(4))
        steps = inst.engine.steps
        while inst.engine.steps < steps + 10:
            await asyncio.sleep(0.005)
        rate = meter.prefill_rate()
        assert rate is not None and meter.rate.tokens == pytest.approx(4.0)  # the cap, every step
        assert rate == pytest.approx(4.0 / meter.rate.seconds)
        inst.convert(ConvertRequest(8))
        assert meter.rate.steps <= 1  # forgotten at the new budget (a step in flight may land one sample)
        steps = inst.engine.steps
        while inst.engine.steps < steps + 40:  # that sample may be the old cap's: the EWMA forgets it
            await asyncio.sleep(0.005)
        assert meter.rate.tokens == pytest.approx(8.0, abs=0.05)
        inst.convert(ConvertRequest(None))
        for r in streams:
            inst.serving.abort(r)
    finally:
        await inst.close()
