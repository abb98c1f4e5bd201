"""From a ModelService's scaling spec and a metrics snapshot to the desired count per role (pure).

Data flow: `Scaling` (CR) + per-role `MetricsSnapshot` + current counts + the remembered scale-down
timer -> kascade_planner.policies -> `RoleDecision` (desired, reason, numbers) + the next timer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kascade_operator.api import ModelServiceSpec
from kascade_planner import policies as P


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    policy: str
    reason: str
    metrics: Mapping[str, float]
    state: P.ScaleState


def decide(spec: ModelServiceSpec, role: str, current: int, lo: int, hi: int, snap: P.MetricsSnapshot,
           below_since_s: float | None = None) -> RoleDecision:
    sc = spec.scaling
    state = P.ScaleState(role, current, P.Bounds(lo, max(hi, 1)), below_since_s=below_since_s)
    policy = sc.policy if sc else "tokenVelocity"
    if sc is not None and sc.policy == "threshold" and sc.threshold is not None:
        t = sc.threshold
        metric = "kvCacheUsage" if t.metric == "kvCacheUsage" else "tokensPerSecond"
        d = P.threshold(snap, state, P.Threshold(t.upper, t.lower, sc.scale_down_delay_seconds, metric))
    elif sc is not None and sc.policy == "concurrency" and sc.concurrency is not None:
        d = P.concurrency(snap, state, sc.concurrency.target_per_instance)
    else:
        tv = sc.token_velocity if sc and sc.token_velocity else None
        if tv is None or (role == "prefill" and not tv.prefill_tokens_per_second) or \
                (role != "prefill" and not tv.decode_tokens_per_second):
            # no velocities configured: hold the current count within bounds
            keep = state.bounds.clamp(current)
            return RoleDecision(role, current, keep, policy, "tokenVelocity: no velocities configured; holding",
                                {}, state)
        if role == "prefill":
            v = P.TokenVelocity(tv.prefill_tokens_per_second or 1.0,
                                tv.network_tokens_per_second or tv.prefill_tokens_per_second or 1.0)
            d = P.token_velocity(snap, state, v)
        else:
            # one bucket: output tokens/s over what one decoder sustains (tokens as the unit of demand)
            bucket = P.Bucket(snap.output_tokens_per_s, tv.decode_tokens_per_second or 1.0)
            d = P.token_velocity(P.MetricsSnapshot(snap.time_s, snap.input_tokens_per_s, snap.output_tokens_per_s,
                                                   snap.in_flight, snap.kv_usage, (bucket,)),
                                 state, P.TokenVelocity(1.0, 1.0))
    return RoleDecision(role, current, d.desired, policy, d.reason, dict(d.metrics), d.state)
