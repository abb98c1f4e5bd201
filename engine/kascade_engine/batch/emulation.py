"""Emulated accelerator timing (benchmarks, `--emulate-layer-ms`): what a step's layer work costs in layer
times (`layer_cost`) and holding the step until that time has passed (`pace`), so a CPU run keeps a GPU's
timing shape. Used by the live split (live/) and the prefill server (pd/); pure, no engine state.
"""

from __future__ import annotations

import time


def layer_cost(tokens: int, layers: int, knee_tokens: int) -> float:
    return layers * (max(1.0, tokens / knee_tokens) if knee_tokens > 0 else 1.0)


def pace(t0: float, layers: float, layer_s: float) -> None:
    """Emulated accelerator (benchmarks, `--emulate-layer-ms`): the step's layer work ends no earlier
    than t0 + layers x layer_s, so its time does not depend on what else shares the CPU. `layers` comes
    from `staggered` with the engine's max_batch_tokens as the knee: a layer forward over up to a full
    batch costs one layer time (memory-bound), more tokens cost proportionally more (compute-bound)."""
    left = t0 + layers * layer_s - time.perf_counter()
    if layer_s > 0 and left > 0:
        time.sleep(left)
