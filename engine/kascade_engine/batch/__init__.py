"""The batching core: one engine step over the model (`engine`: schedule -> forward -> sample ->
postprocess), its scheduler and prefill budget, the paged KV cache, sampling, the step hooks a live split
plugs into (`StepHooks`), and the step timings it records (`velocity`, `stepcost`).

Lowest wing of the engine: it imports nothing of the engine above it (torch, the standard library and
kascade_planner only; the import-linter contracts in pyproject.toml hold it to that).
"""
