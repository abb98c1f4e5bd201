"""`--emulate-layer-ms` (benchmarks): a step's layer work takes at least that long per layer forward, so
engines sharing a CPU keep an accelerator-like step time; the flag's bad values are named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kascade_engine.batch.emulation import pace
from kascade_engine.config import ConfigError, EngineConfig


def test_pace_holds_the_step_to_layers_times_the_emulated_layer_time() -> None:
    t0 = time.perf_counter()
    pace(t0, 3, 0.02)
    assert time.perf_counter() - t0 >= 0.06  # a lower bound: sleeping never ends early
    t1 = time.perf_counter()
    pace(t1, 2, 0.05)
    assert time.perf_counter() - t1 >= 0.1


def test_bad_emulate_layer_ms_is_named() -> None:
    with pytest.raises(ConfigError, match="--emulate-layer-ms must be in"):
        EngineConfig(Path("."), "m", "t", emulate_layer_ms=-1)
    assert EngineConfig(Path("."), "m", "t", emulate_layer_ms=2.5).emulate_layer_ms == 2.5
    with pytest.raises(ConfigError, match="--emulate-knee-tokens must be in"):
        EngineConfig(Path("."), "m", "t", emulate_knee_tokens=-1)


async def test_a_zigzag_hold_ends_when_the_load_stalls() -> None:
    """A request ZigZag holds for a prefix that never lands is released (best effort), not held forever."""
    from kascade_engine.live.livepolicy import hold_until

    layers = [2]
    assert await hold_until(lambda: layers[0], 2, limit_s=5.0) is True
    assert await hold_until(lambda: layers[0], 3, poll=0.01, limit_s=0.05) is False
