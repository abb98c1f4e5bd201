"""bench/pd.py's accelerator emulation (`--emulate-layer-ms`): the condition convertible decoders (TokenScale)
need, decoders with idle compute during a prefill burst, reproduced on CPU engines with the engine's own
emulation flags, the same for every engine of every setup and for the calibration's engine.

What the engine emulates (kascade_engine.live.cooperation.pace / staggered, prefill_server.KVShipper.forward):
- A step's layer work ends no earlier than t0 + cost x `--emulate-layer-ms`, with cost = the layers run, each
  counted max(1, tokens at that layer / `--emulate-knee-tokens`) (knee 0: 1 per layer whatever its tokens). It
  is a FLOOR: a step whose CPU compute takes longer ends later, and then the CPU's batch-dependence shows
  through. `floor_check` reports, from each engine's step histogram, how often that happened.
- A prefill engine's KV-shipping forward paces (layer + 1) x the layer time: one layer time per layer whatever
  its tokens (the knee is not applied on that path).

Why a per-token term, and which: with the layer time alone, a step of `--max-batch-tokens` prompt tokens costs
what a one-token decode step costs. A 420-token prompt would prefill in one decode step's time (batch 512),
and a prefill engine's velocity would be set by its token budget alone. On a GPU a prompt token costs compute:
the simulator's model of the same setup (llama3-8b on an A800) charges a step p0 = 12 ms plus p1 = 0.103 ms per
token, so a 420-token prefill costs 4.6 decode steps. The emulation therefore puts the knee where the
simulator's per-token compute equals its fixed per-step cost, K = p0 / p1 (117 tokens; `sim_knee_tokens`):
below it a step costs one layer time per layer (memory-bound: a decoder's batch does not make its step
slower), above it proportionally more (compute-bound). Because the KV-shipping path does not apply the knee,
every engine also gets `--max-batch-tokens K`: no step holds more than K tokens, so a step costs exactly one
layer time per layer on every path, and a prompt token costs layers x layer time / K in full chunks, on the
prefill engine, on a colocated engine and on a converted decoder alike.

Where it differs from the simulator (stated, not hidden): the simulator ADDS the token term to the fixed one
(step = p0 + p1 x tokens); the emulation takes the larger of the two (roofline). So on the emulated
accelerator a prompt chunk beside decodes costs nothing until the step holds K tokens, where the simulator
charges p1 per token: the emulated decoder is at least as idle as the simulated one. A 420-token prompt alone
takes ceil(420 / K) = 4 steps here, 4.6 decode steps in the simulator.

Data flow: pd.main -> `Emulation` -> `engine_args()` (every engine's flags) and `describe()` (pd.json's `engines`);
after a setup, its engines' step histograms (pdconvert.step_times) -> `floor_check` -> the setup's `emulation_floor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LAYERS = 8  # the bench model's layers (pd.py builds it with these): a step's floor is LAYERS x the layer time
# a step this much over its floor counts as one the CPU, not the emulation, timed (the sampling after the paced
# layers adds a millisecond or two)
FLOOR_SLACK = 1.02


def sim_knee_tokens() -> int:
    """The token count at which the simulator's per-token compute equals its fixed step cost (llama3-8b on an
    A800, the model sim_side runs): where a GPU step turns from memory-bound to compute-bound."""
    from kascade_sim.hardware import model

    cost = model("llama3-8b").cost
    return round(cost.p0 / cost.p1)


@dataclass(frozen=True)
class Emulation:
    """An emulated accelerator: each layer forward at least `layer_ms`, one layer time per step of up to
    `knee_tokens` tokens (which is also every engine's token budget per step)."""

    layer_ms: float
    knee_tokens: int

    def __post_init__(self) -> None:
        if not 0 < self.layer_ms <= 10_000 or math.isnan(self.layer_ms):
            raise ValueError(f"--emulate-layer-ms must be in (0, 10000], got {self.layer_ms}")
        if not 16 <= self.knee_tokens <= 4096:  # at least a page, so a step always makes progress
            raise ValueError(f"--emulate-knee-tokens must be in [16, 4096], got {self.knee_tokens}")

    @property
    def step_floor_s(self) -> float:
        """A step's emulated time (every step holds at most knee_tokens tokens)."""
        return LAYERS * self.layer_ms / 1e3

    def engine_args(self) -> list[str]:
        """The emulation flags every engine of the bench runs with (pd.engine also sets --max-batch-tokens to
        knee_tokens)."""
        return ["--emulate-layer-ms", f"{self.layer_ms:g}", "--emulate-knee-tokens", str(self.knee_tokens)]

    def describe(self) -> dict[str, Any]:
        """pd.json's `engines`: what timed the engines' steps."""
        return {
            "emulated": True,
            "layer_ms": self.layer_ms,
            "knee_tokens": self.knee_tokens,
            "max_batch_tokens": self.knee_tokens,
            "step_floor_ms": self.step_floor_s * 1e3,
            "prompt_token_ms": self.step_floor_s * 1e3 / self.knee_tokens,
            "compute": (
                f"EMULATED accelerator: every step's layer work takes at least {LAYERS} x {self.layer_ms:g} ms "
                f"(engine --emulate-layer-ms), steps of at most {self.knee_tokens} tokens (--max-batch-tokens "
                f"= --emulate-knee-tokens, the simulator's memory/compute knee); the CPU computes under that "
                "floor (emulation_floor per setup: how often it did not). Tokens, KV transfers, HTTP, router "
                "and operator loop are real. Headline numbers come from the real CPU mode (no flag)"
            ),
        }


def real_cpu() -> dict[str, Any]:
    """pd.json's `engines` without emulation."""
    return {"emulated": False, "compute": "real CPU: one core per engine, fp32, one torch thread"}


def floor_check(steps: dict[str, Any], emu: Emulation) -> dict[str, Any]:
    """Per engine and step kind (from its kascade_step_seconds histogram): the mean step against the emulated
    floor, and the share of steps above the first histogram bound at or past FLOOR_SLACK x the floor (steps
    the CPU timed, not the emulation: a mean near the floor and a share near 0 mean the emulation held)."""
    floor = emu.step_floor_s
    out: dict[str, Any] = {}
    for name, eng in steps.items():
        for kind, h in eng.items():
            if not isinstance(h, dict) or not h.get("count"):
                continue
            bounds = sorted((float(le), n) for le, n in h.get("le", {}).items() if le != "+Inf")
            over = [(b, n) for b, n in bounds if b >= FLOOR_SLACK * floor]
            row: dict[str, Any] = {
                "steps": int(h["count"]),
                "mean_ms": round(h["sum"] / h["count"] * 1e3, 1),
                "floor_ms": round(floor * 1e3, 1),
            }
            if over:
                row["over_ms"] = over[0][0] * 1e3
                row["over_share"] = round(1 - over[0][1] / h["count"], 3)
            out[f"{name}.{kind}"] = row
    return out
