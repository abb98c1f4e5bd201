"""Disaggregated scaling, pure: from a ModelService and its per-role metrics to the P:D ratio decision
and to the convertible-decoder input.

Data flow: `ModelServiceSpec` + each role's `RoleInput` (serving count, bounds, metrics) ->
- `velocities`: typed `spec.scaling.tokenVelocity` values win, the engines' measured ones fill the gaps;
- `demand`: the prompt tokens/s arriving at the service and the decode demand (max(measured output tokens/s,
  arriving requests/s x the output length estimated from recent history): kascade_planner.outputlength). Every request
  arrives at one
  engine, which counts its prompt (a decoder counts it even when a prefiller prefills it; a prefiller
  counts it again), so the larger of the two roles' rates is the arrival rate, whichever engines saw it;
- `ratio_decisions`: the per-role decisions with prefill and decode replaced by
  `kascade_planner.pdratio.pd_ratio` (both counts from one demand), the SLO bump on top;
- `conversion_input`: what `kascade_planner.conversion.plan_conversions` needs, the decoders' measured
  decode step time included (the chunk budget's room) and a measured prefill velocity only once it is a
  capacity (saturated steps; kascade_planner.prefillvelocity); the operator's converter.py applies its answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleDecision, RoleInput, slo_of
from kascade_operator.pool import PodView
from kascade_planner import policies as P
from kascade_planner.conversion import ConversionInput, DecoderView, converted_share
from kascade_planner.outputlength import DecodeDemand
from kascade_planner.outputlength import decode_demand as decode_demand_of
from kascade_planner.pdratio import PdDemand, PdVelocity, pd_ratio


@dataclasses.dataclass(frozen=True)
class Velocities:
    prefill: float | None  # one prefiller's prompt tokens/s
    network: float | None  # KV link tokens/s out of one prefiller (defaults to prefill)
    decode: float | None  # one decoder's output tokens/s

    @property
    def prefill_effective(self) -> float | None:
        return None if self.prefill is None else min(self.prefill, self.network or self.prefill)


def velocities(spec: ModelServiceSpec, snaps: Sequence[P.MetricsSnapshot], capacity: bool = False) -> Velocities:
    """Typed velocities win; a velocity left out is the engines' own measurement (first role measuring it).
    `capacity`: the measured prefill velocity only from saturated steps (None before one), never the floor
    (kascade_planner.prefillvelocity: the conversion policy's, a deficit against a lower bound is none)."""
    tv = spec.scaling.token_velocity if spec.scaling else None

    def measured(f: str) -> float | None:
        return next((getattr(s.measured, f) for s in snaps if s.measured and getattr(s.measured, f)), None)

    pre = (tv.prefill_tokens_per_second if tv else None) or measured(
        "prefill_capacity_tokens_per_s" if capacity else "prefill_tokens_per_s")
    net = (tv.network_tokens_per_second if tv else None) or measured("network_tokens_per_s") or pre
    dec = (tv.decode_tokens_per_second if tv else None) or measured("decode_tokens_per_s")
    return Velocities(pre, net, dec)


def decode_demand(roles: Sequence[RoleInput]) -> DecodeDemand:
    """The largest role's decode demand: arrivals are counted by both roles (as prompts are), output tokens and
    finished requests only where requests finish (decoders), so the decoders' projection is the larger."""
    return max((r.snap.decode_demand for r in roles), key=lambda d: d.tokens_per_s,
               default=decode_demand_of(0.0, 0.0, None))


def demand(roles: Sequence[RoleInput]) -> PdDemand:
    dd = decode_demand(roles)
    return PdDemand(max((r.snap.input_tokens_per_s for r in roles), default=0.0), dd.tokens_per_s, dd.reason)


def ratio_decisions(spec: ModelServiceSpec, roles: Sequence[RoleInput],
                    decisions: Sequence[RoleDecision]) -> list[RoleDecision]:
    """Disaggregated tokenVelocity services with both roles policy-driven and all three velocities known:
    prefill and decode come from the P:D ratio policy. Anything else: `decisions` unchanged."""
    by = {r.role: r for r in roles}
    dec_by = {d.role: d for d in decisions}
    if spec.mode != "disaggregated" or (spec.scaling is not None and spec.scaling.policy != "tokenVelocity") \
            or set(by) != {"prefill", "decode"} \
            or any(dec_by[r].policy == "scaleSubresource" for r in ("prefill", "decode")):
        return list(decisions)
    v = velocities(spec, [r.snap for r in roles])
    if v.prefill is None or v.decode is None:
        return list(decisions)
    pr, de = by["prefill"], by["decode"]
    dd = decode_demand(roles)
    ratio = pd_ratio(demand(roles), PdVelocity(v.prefill, v.network or v.prefill, v.decode),
                     P.Bounds(pr.lo, max(pr.hi, 1)), P.Bounds(de.lo, max(de.hi, 1)))
    slo = slo_of(spec)
    out = []
    for d in decisions:
        if d.role not in ("prefill", "decode"):
            out.append(d)
            continue
        r = by[d.role]
        want, why = P.slo_bump(r.snap, d.state, ratio.prefill if d.role == "prefill" else ratio.decode, slo)
        metrics = {**d.metrics, "prefillNeed": ratio.prefill_need, "decodeNeed": ratio.decode_need,
                   "servedFraction": ratio.served_fraction, **dict(dd.metrics)}
        out.append(dataclasses.replace(d, desired=want, reason=ratio.reason + why, metrics=metrics))
    return out


def conversion_input(spec: ModelServiceSpec, key: str, pods: Sequence[PodView],
                     roles: Sequence[RoleInput]) -> ConversionInput | None:
    """None unless the service is disaggregated (only decoders convert)."""
    if spec.mode != "disaggregated":
        return None
    mine = [p for p in pods if p.model_service == key and not p.draining]
    decoders = tuple(DecoderView(p.pod_name, p.convertible) for p in sorted(mine, key=lambda p: p.pod_name)
                     if p.role == "decode" and p.ready and p.endpoint)
    pre = next((r for r in roles if r.role == "prefill"), None)
    dec = next((r for r in roles if r.role == "decode"), None)
    slo = slo_of(spec)
    # a converted decoder's share of a prefiller, measured: the decoders' prefill rate (only a converted decoder
    # prefills in disaggregated serving; the engine forgets its rate when its budgets change) over the prefillers'
    rates = [r.snap.measured.prefill_rate_tokens_per_s if r and r.snap.measured else None for r in (dec, pre)]
    share = converted_share(*rates) if all(rates) else None
    return ConversionInput(demand(roles).input_tokens_per_s,
                           sum(1 for p in mine if p.role == "prefill" and p.ready),
                           velocities(spec, [r.snap for r in roles], capacity=True).prefill_effective, decoders,
                           pre.snap.queue_length if pre else None, slo.tbt_s if slo else None,
                           dec.snap.decode_step_s if dec else None, slo.ttft_s if slo else None, share)
