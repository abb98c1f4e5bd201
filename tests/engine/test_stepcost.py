"""The engine's step-time model (stepcost.py): fitted online from its own steps, it recovers a step's cost
per decode row, prompt token and gathered key, and tells a converted decoder's scheduler how much of a
prompt chunk fits the time a step has left."""

from __future__ import annotations

import random

import pytest

from kascade_engine.batch.stepcost import TIMED_STEPS, StepCost, StepShape

# a made-up engine: 6 ms of weights, 0.1 ms per decode row, 0.8 ms per prompt token, 4 ms per 1000 keys
BASE, ROW, TOKEN, KILOKEY = 6e-3, 1e-4, 8e-4, 4e-3


def _true(shape: StepShape) -> float:
    _, rows, tokens, kilokeys = shape.features()
    return BASE + ROW * rows + TOKEN * tokens + KILOKEY * kilokeys


def _fed(steps: int = 300, seed: int = 1, noise: float = 0.0) -> StepCost:
    """A model fed the made-up engine's steps: decode-only and mixed, batches 1-24, contexts 20-450."""
    rng = random.Random(seed)
    c = StepCost()
    for _ in range(steps):
        shape = StepShape(rng.randint(1, 24), rng.randint(20, 450))
        if rng.random() < 0.4:
            start = rng.randint(0, 400)
            shape = shape.with_chunk(start, rng.randint(2, 32))
        c.observe(shape, _true(shape) * (1 + rng.uniform(-noise, noise)))
    return c


def test_the_fit_recovers_the_step_cost_from_the_engines_own_steps() -> None:
    c = _fed()
    assert c.theta == pytest.approx([BASE, ROW, TOKEN, KILOKEY], rel=1e-3, abs=1e-6)
    assert c.token_s == pytest.approx(TOKEN, rel=1e-3)
    noisy = _fed(noise=0.2)  # +-20 % per step (the bench's machine): still the right size
    assert noisy.token_s == pytest.approx(TOKEN, rel=0.25)


def test_no_prompt_token_cost_until_steps_with_prompt_tokens_were_timed() -> None:
    c = StepCost()
    for b in range(1, 50):
        c.observe(StepShape(b, 300), _true(StepShape(b, 300)))
    assert c.token_s is None and c.chunk_fits(0.05, StepShape(4, 300), 0, 64) is None
    for i in range(TIMED_STEPS):
        shape = StepShape(4, 300).with_chunk(16 * i, 16)
        c.observe(shape, _true(shape))
    assert c.token_s is not None


def test_a_chunk_is_cut_to_the_time_the_decodes_leave() -> None:
    c = _fed()
    small, big = StepShape(2, 60), StepShape(20, 420)  # decodes alone: about 6.7 ms and 40 ms
    budget = 0.028
    n = c.chunk_fits(budget, small, 100, 256)
    assert n is not None and 0 < n < 256
    assert _true(small.with_chunk(100, n)) <= budget + 1e-4 < _true(small.with_chunk(100, n + 1))
    assert c.chunk_fits(budget, big, 100, 256) == 0  # the decodes alone are past the budget: no chunk
    assert c.chunk_fits(1.0, small, 100, 256) == 256  # room for all of it


def test_a_step_shape_is_read_from_the_steps_work_as_the_attention_gathers_it() -> None:
    shape = StepShape.of([(40, 1), (99, 1), (0, 16), (200, 8)])
    assert shape == StepShape(decodes=2, decode_key_max=100, prompt_tokens=24, prefill_seqs=2, prefill_key_max=208)
    assert shape.features() == (1.0, 2.0, 24.0, (2 * 100 + 2 * 208) / 1000)
    with pytest.raises(ValueError, match="prompt_tokens"):
        StepShape(prompt_tokens=-1)
    c = StepCost()
    c.observe(shape, float("nan"))  # an unusable timing is skipped
    c.observe(shape, 0.0)
    assert c.steps == 0
