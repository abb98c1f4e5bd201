"""bench/pd.py's accelerator emulation (`--emulate-layer-ms`, bench/pdemulate.py): the flags reach every engine
the bench starts (a real engine process: its steps take the emulated time, its token budget is the knee), the
calibration's engine and both engines of a setup get the same emulation, bad values are named, and the floor
check reads an engine's step histogram. No bench run here."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest

from kascade_engine.weights.checkpoint import tiny_llama

BENCH = Path(__file__).parents[2] / "bench"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # pd.py imports its helpers (pdreport, pdconvert, pdemulate) by name
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bad_emulation_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    emu = _load("pdemulate", monkeypatch)
    with pytest.raises(ValueError, match="--emulate-layer-ms must be in"):
        emu.Emulation(0.0, 117)
    with pytest.raises(ValueError, match="--emulate-layer-ms must be in"):
        emu.Emulation(math.nan, 117)
    with pytest.raises(ValueError, match="--emulate-knee-tokens must be in"):
        emu.Emulation(20.0, 4)
    e = emu.Emulation(20.0, 117)
    assert e.engine_args() == ["--emulate-layer-ms", "20", "--emulate-knee-tokens", "117"]
    assert e.describe()["emulated"] is True and "EMULATED" in e.describe()["compute"]
    assert e.step_floor_s == pytest.approx(emu.LAYERS * 0.020)


def test_the_default_knee_is_the_simulators_memory_compute_knee(monkeypatch: pytest.MonkeyPatch) -> None:
    from kascade_sim.hardware import model

    cost = model("llama3-8b").cost
    knee = _load("pdemulate", monkeypatch).sim_knee_tokens()
    # at the knee a step's token compute equals its fixed cost (within one token)
    assert abs(cost.p1 * knee - cost.p0) <= cost.p1


def test_the_floor_check_counts_steps_the_cpu_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    emu = _load("pdemulate", monkeypatch)
    e = emu.Emulation(30.0, 117)  # floor 240 ms: the first bound >= 1.02 x floor is 0.25 s
    steps = {
        "a": {
            "prefill": {"count": 10.0, "sum": 2.6, "le": {"0.1": 0.0, "0.25": 9.0, "0.5": 10.0, "+Inf": 10.0}},
            "prefill_step_tokens_max": 117.0,
        },
        "b": {
            "decode": {"count": 4.0, "sum": 0.98, "le": {"0.25": 4.0, "0.5": 4.0, "+Inf": 4.0}},
            "mixed": {"count": 0.0},
        },
    }
    got = emu.floor_check(steps, e)
    assert got["a.prefill"] == {"steps": 10, "mean_ms": 260.0, "floor_ms": 240.0, "over_ms": 250.0, "over_share": 0.1}
    assert got["b.decode"]["over_share"] == 0.0
    assert set(got) == {"a.prefill", "b.decode"}


def test_calibration_and_both_engines_of_a_setup_get_the_emulation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pd = _load("pd", monkeypatch)
    e = pd.Emulation(30.0, 117)
    seen: list[Any] = []

    def fake_engine(*args: Any, **kw: Any) -> Any:
        seen.append(kw.get("emu"))
        if len(seen) in (1, 3):  # the calibration's engine; a setup's second engine
            raise RuntimeError("stop here")
        return None, 1, 2

    monkeypatch.setattr(pd, "engine", fake_engine)
    monkeypatch.setattr(pd, "stop", lambda procs: None)
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(pd.calibrate(tmp_path, 4, e))
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(pd.setup(tmp_path, "disaggregated", [], 4, None, e))
    assert seen == [e, e, e]


@pytest.mark.slow
def test_the_emulation_flags_reach_a_real_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pd.engine with an emulation: the process runs with the flags, every step takes at least the floor and
    holds at most the knee's tokens (a 40-token prompt prefills in 3 steps of 16). Without them its first token
    would come after one CPU step of a tiny model (milliseconds)."""
    pd = _load("pd", monkeypatch)
    ckpt = tiny_llama(tmp_path / pd.MODEL, layers=pd.LAYERS, hidden=64, vocab=2048, kv_heads=4)
    e = pd.Emulation(40.0, 16)
    p, http, _ = pd.engine(ckpt, emu=e)
    try:
        cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode().split("\0")
        assert cmd[cmd.index("--emulate-layer-ms") + 1] == "40"
        assert cmd[cmd.index("--emulate-knee-tokens") + 1] == "16"
        assert cmd[cmd.index("--max-batch-tokens") + 1] == "16"

        async def go() -> tuple[float, float, int]:
            async with aiohttp.ClientSession() as s:
                return await pd.one(s, f"http://127.0.0.1:{http}", list(range(1, 41)), 3)

        ttft, tbt, n = asyncio.run(go())
        assert n == 3
        assert ttft >= 3 * e.step_floor_s  # ceil(40 / 16) prefill steps, each at least 8 layers x 40 ms
        # the last token came after 3 prefill and 2 decode steps; one gap alone can look shorter than a step when
        # the token before it reached the client late (CI saw 0.315 s for a 0.32 s floor), their sum cannot
        assert ttft + (n - 1) * tbt >= (3 + n - 1) * e.step_floor_s
        assert tbt >= 0.9 * e.step_floor_s
    finally:
        pd.stop([p])
