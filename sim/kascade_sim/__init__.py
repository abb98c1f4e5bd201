"""kascade_sim: a deterministic trace-driven cluster simulator driving the planner's own code.

Data flow: `workload` (Azure LLM 2023 / BurstGPT readers, windows, rate scaling, synthetic bursts) ->
`simulator.Simulation` (discrete events over `instance.Instance` continuous-batching engines on a
`hardware.Hardware` cluster, scaled by the planner's threshold policy; scale-ups planned with the
planner's chain / binomial / local plans and cost model, live pairs sized by its ZigZag schedule) ->
`result.Result` (TTFT/TBT, SLOs, GPU time, host cache, scale events) -> `compare` / `plots`.
The compared systems are configurations (`systems`).
"""
