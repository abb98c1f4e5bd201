"""Simulation settings: the autoscaling policy, its tick and window, instance bounds and the serving mode.

Data flow: CLI flags / bench points -> `SimConfig` (validated here, naming the bad field) -> read by
`simulator.Simulation` and its parts (`scaling`, `serving`, `autoscaler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kascade_planner.policies import Threshold


@dataclass(frozen=True)
class SimConfig:
    # Prefill (or colocated) instances: BlitzScale's policy scales on the queue (requests waiting, plus
    # the busy fraction of each instance, per instance: scale up on a backlog, down when instances idle);
    # `metric="tokensPerSecond"` scales on the token rate instead.
    policy: Threshold = field(default_factory=lambda: Threshold(4.0, 0.3, 5.0, "queueLength"))
    # Decode instances scale on KV usage (the larger of the KV and batch-slot fractions).
    decode_policy: Threshold = field(default_factory=lambda: Threshold(0.8, 0.3, 5.0, "kvCacheUsage"))
    decoders_per_prefiller: float = 0.5  # BlitzScale §5: decode pre-scaled with prefill, whole decoders (0: off)
    tick_s: float = 0.5  # policy evaluation period
    window_s: float = 2.0  # metrics averaged over this window
    min_instances: int = 1  # per model and role
    max_instances: int | None = None  # per model and role; default: every GPU
    target_utilization: float = 0.7  # initial and static sizing: load per instance / its capacity
    seed: int = 0
    ttft_slo_s: float = 1.0
    tbt_slo_s: float = 0.1
    # "disaggregated": prefill and decode instances scale separately; KV moves prefill -> decode over
    # the scale-out network after each prefill, once a decoder has room for it.
    mode: str = "colocated"
    # Disaggregated mode: "threshold" scales each role on its own metric (`policy`, `decode_policy`);
    # "tokenVelocity" takes both counts from the operator's P:D ratio policy (kascade_planner.pdratio).
    pd_policy: str = "threshold"
    # Colocated mode, several models: the fleet's arbitration (kascade_planner.arbitration) decides every tick who
    # gets the free GPUs and whose idle replicas are preempted (priority, SLO pressure, fair share; never below a
    # model's `min_instances`; a replica bound within `hysteresis_s` is kept). None (default): on for colocated runs
    # of several models. Off (and in disaggregated mode): each model scales in turn and a model with no instance
    # preempts the longest-up idle one (`scaling._preempt_idle`).
    arbitration: bool | None = None
    hysteresis_s: float = 30.0
    priorities: tuple[int, ...] = ()  # per model index (missing: 0)

    def __post_init__(self) -> None:
        if self.pd_policy not in ("threshold", "tokenVelocity"):
            raise ValueError(f"pd_policy must be threshold or tokenVelocity, got {self.pd_policy!r}")
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode must be colocated or disaggregated, got {self.mode!r}")
        if not (0 < self.tick_s <= 60) or not (0 < self.window_s <= 3600):
            raise ValueError(f"need 0 < tick_s <= 60 and 0 < window_s <= 3600, got {self.tick_s}, {self.window_s}")
        if self.min_instances < 0 or (
            self.max_instances is not None and self.max_instances < max(1, self.min_instances)
        ):
            raise ValueError(f"need 0 <= min_instances <= max_instances and max >= 1, got {self.min_instances}, "
                             f"{self.max_instances}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.decoders_per_prefiller <= 16:
            raise ValueError(f"decoders_per_prefiller must be in [0, 16], got {self.decoders_per_prefiller}")
        if self.arbitration and self.mode != "colocated":
            raise ValueError("arbitration: only colocated mode is arbitrated across models (mode is disaggregated)")
        if not self.hysteresis_s >= 0:
            raise ValueError(f"hysteresis_s must be >= 0, got {self.hysteresis_s}")
        if self.decode_policy.metric == "queueLength":
            raise ValueError(
                "decode_policy: decode instances have no prefill queue (use kvCacheUsage or tokensPerSecond)"
            )


