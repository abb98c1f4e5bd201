"""From a ModelService's scaling spec and a metrics snapshot to the desired count per role (pure).

Data flow: `Scaling` (CR) + per-role `MetricsSnapshot` + current counts + the remembered scale-down
timer -> kascade_planner.policies -> `RoleDecision` (desired, reason, numbers) + the next timer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

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


def slo_of(spec: ModelServiceSpec) -> P.Slo | None:
    if spec.slo is None or (spec.slo.ttft_ms is None and spec.slo.tbt_ms is None):
        return None
    return P.Slo(spec.slo.ttft_ms / 1000 if spec.slo.ttft_ms else None,
                 spec.slo.tbt_ms / 1000 if spec.slo.tbt_ms else None)


def decide(spec: ModelServiceSpec, role: str, current: int, lo: int, hi: int, snap: P.MetricsSnapshot,
           below_since_s: float | None = None) -> RoleDecision:
    sc = spec.scaling
    state = P.ScaleState(role, current, P.Bounds(lo, max(hi, 1)), below_since_s=below_since_s)
    policy = sc.policy if sc else "tokenVelocity"
    if sc is not None and sc.policy == "threshold" and sc.threshold is not None:
        t = sc.threshold
        d = P.threshold(snap, state, P.Threshold(t.upper, t.lower, sc.scale_down_delay_seconds, t.metric))
    elif sc is not None and sc.policy == "concurrency" and sc.concurrency is not None:
        d = P.concurrency(snap, state, sc.concurrency.target_per_instance)
    else:
        tv = sc.token_velocity if sc and sc.token_velocity else None
        slo = slo_of(spec)
        # typed velocities win; a velocity left out is the engines' own measurement (kascade_engine.batch.velocity)
        meas = snap.measured or P.MeasuredVelocity()
        pre = (tv.prefill_tokens_per_second if tv else None) or meas.prefill_tokens_per_s
        net = (tv.network_tokens_per_second if tv else None) or meas.network_tokens_per_s or pre
        dec = (tv.decode_tokens_per_second if tv else None) or meas.decode_tokens_per_s
        if (role == "prefill" and not pre) or (role != "prefill" and not dec):
            # no velocities configured or measured yet: hold the current count within bounds (the SLO may
            # still ask for more)
            keep = state.bounds.clamp(current)
            want, why = P.slo_bump(snap, state, keep, slo)
            return RoleDecision(role, current, want, policy, "tokenVelocity: no velocities configured or measured; "
                                "holding" + why, {}, state)
        typed = tv is not None and bool(tv.prefill_tokens_per_second if role == "prefill" else
                                        tv.decode_tokens_per_second)
        if role == "prefill":
            assert pre is not None and net is not None
            d = P.token_velocity(snap, state, P.TokenVelocity(pre, net))
        else:
            assert dec is not None
            # one bucket: decode demand (output tokens/s; arrivals x the output length estimated from recent
            # history, so a burst counts before it generates) over what one decoder sustains
            dd = snap.decode_demand
            bucket = P.Bucket(dd.tokens_per_s, dec)
            d = P.token_velocity(P.MetricsSnapshot(snap.time_s, snap.input_tokens_per_s, snap.output_tokens_per_s,
                                                   snap.in_flight, snap.kv_usage, (bucket,)),
                                 state, P.TokenVelocity(1.0, 1.0))
            d = replace(d, reason=f"{d.reason} ({dd.reason} / decode {dec:.0f})",
                        metrics=(*d.metrics, *dd.metrics))
        if not typed:
            d = replace(d, reason=d.reason.replace("tokenVelocity:", "tokenVelocity (measured velocities):", 1))
        want, why = P.slo_bump(snap, state, d.desired, slo)
        metrics = dict(d.metrics)
        if snap.ttft_s is not None:
            metrics["ttftSeconds"] = snap.ttft_s
        if snap.tbt_s is not None:
            metrics["tbtSeconds"] = snap.tbt_s
        return RoleDecision(role, current, want, policy, d.reason + why, metrics, d.state)
    return RoleDecision(role, current, d.desired, policy, d.reason, dict(d.metrics), d.state)


@dataclass(frozen=True)
class RoleInput:
    """What one role looks like this round: serving count, bounds, its metrics, its scale-down timer."""

    role: str
    serving: int
    lo: int
    hi: int
    snap: P.MetricsSnapshot
    below_since_s: float | None = None


@dataclass(frozen=True)
class Round:
    desired: Mapping[str, int]  # roles whose count the reconciler should move (others: keep/min)
    decisions: tuple[RoleDecision, ...]  # every role's decision (changes and holds)
    changes: tuple[RoleDecision, ...]  # the roles whose desired differs from their serving count


def decide_roles(spec: ModelServiceSpec, roles: list[RoleInput], trigger: str, now: str = "",
                 sources: Mapping[str, str] | None = None) -> Round:
    """The per-role policy loop, pure: a role with a set desired count (scale subresource, per-role
    `desired`, or a ModelServiceRole: `sources` names where it came from) is that count and the policy
    stays off for it; otherwise the policy decides."""
    from kascade_operator.pdscaling import ratio_decisions  # it imports this module's types
    from kascade_operator.reconcile import role_bounds, role_want  # reconcile imports nothing from here

    bounds = role_bounds(spec)
    desired: dict[str, int] = {}
    decisions: list[RoleDecision] = []
    for r in roles:
        fixed = role_want(spec, r.role, bounds[r.role])
        if fixed is not None:
            want = max(r.lo, min(r.hi, fixed))
            where = (sources or {}).get(r.role) or (f"spec.replicas.{r.role}.desired={fixed}"
                                                     if bounds[r.role].desired is not None
                                                     else f"spec.replicas.desired={fixed}")
            d = RoleDecision(r.role, r.serving, want, "scaleSubresource",
                             f"{where} (set: the policy is off for this role while it is)", {},
                             P.ScaleState(r.role, r.serving, P.Bounds(r.lo, max(r.hi, 1)), below_since_s=None))
        else:
            d = decide(spec, r.role, r.serving, r.lo, r.hi, r.snap, r.below_since_s)
        decisions.append(d)
    # disaggregated: prefill and decode sized together by the P:D ratio policy (pdscaling.py)
    decisions = ratio_decisions(spec, roles, decisions)
    for d in decisions:
        if d.policy != "scaleSubresource" and (trigger == "timer" or d.desired != d.current):
            desired[d.role] = d.desired
    return Round(desired, tuple(decisions), tuple(d for d in decisions if d.desired != d.current))
