"""Host copy: which complete copy of its model an engine may keep in host memory (issue 18's host-memory
parameter pool), within its --host-cache-gib budget. Pure: EngineInstance applies the answer at release
(`release`) and when the operator asks a serving engine to keep one (`keep_copy`, POST host-copy).

Data flow: the engine's complete blockset (None while it loads or holds nothing) + the budget in bytes ->
`keepable` -> (the BlockSet to keep, None) or (None, why not: a sentence for the log and the control answer).
The copy is the blockset itself, never a second one: its verified host buffers (zero-copy views on the CPU;
on CUDA the device weights are separate tensors copied from them), so keeping it costs no bytes beyond those.
"""

from __future__ import annotations

from kascade_engine.weights.blocks import BlockSet


def keepable(full: BlockSet | None, budget_bytes: int, model: str) -> tuple[BlockSet | None, str | None]:
    """The copy to keep (None: none) and why not."""
    if full is None:
        return None, f"holds no complete copy of {model} to keep"
    if full.total_bytes > budget_bytes:
        if not budget_bytes:
            return None, "no --host-cache-gib budget (0: never keeps one)"
        return None, (f"the model's {full.total_bytes / 1e6:.1f} MB exceed the --host-cache-gib budget "
                      f"({budget_bytes / 1e6:.1f} MB)")
    return full, None
