"""The simulator's disaggregated decisions, made by the operator's own pure policies: the P:D ratio
(`kascade_planner.pdratio.pd_ratio`, the tokenVelocity policy of a disaggregated service) and the
convertible decoders (`kascade_planner.conversion.plan_conversions`). Nothing here decides: it builds
the policies' typed inputs from the simulator's state and applies their answers.

Data flow, every tick, per model: the window's prompt and output tokens/s (`Simulation.demand`) + one
instance's velocities from the engine cost model (`velocities`) + the role bounds -> `pd_ratio` ->
desired prefill and decode counts (`ratio_decisions`, as `policies.Decision`s for `Scaling`); the same
prompt tokens/s + serving prefillers + the decoders (each with its policy flag `Instance.convertible`) +
the prefill queue + the TBT and TTFT objectives + the converted decoders' measured share of a prefiller
(`measured_share`, from the rates `Serving._measure` takes as the engines do) -> `plan_conversions` -> flags set or
cleared, the chunk
budget and the hand-back bound (`apply_conversions`). `Serving._converts` lets only a flagged decoder take
prefill. Every call is logged (`Simulation.policy_calls`: time, policy, input, answer) so a test can call
the policy again on the same input and compare.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from typing import TYPE_CHECKING

from kascade_planner.conversion import (
    ConversionInput,
    Conversions,
    DecoderView,
    converted_share,
    plan_conversions,
)
from kascade_planner.outputlength import OutputLength, decode_demand
from kascade_planner.pdratio import PdDemand, PdRatio, PdVelocity, pd_ratio
from kascade_planner.policies import Decision, ScaleState
from kascade_sim.provisioning import capacity_rps, mean_lengths

if TYPE_CHECKING:
    from kascade_sim.state import SimState


def velocities(sim: SimState, m: int) -> PdVelocity:
    """One instance's velocities from the cost model, as the engines would measure them: a full prefill
    batch's prompt tokens/s (a saturated step: the engines' prefill velocity is the capacity of such steps,
    kascade_planner.prefillvelocity; an engine reports its best unsaturated step until it saw one, the
    simulator knows it from the start), the KV link's tokens/s out of a prefiller (scale-out bandwidth / KV
    bytes per token), and a saturated decoder's output tokens/s at the trace's mean lengths. Fixed for a run:
    computed once per model (the mean lengths walk the whole trace)."""
    if m in sim.pd_velocity:
        return sim.pd_velocity[m]
    spec = sim.spec
    prefill = spec.max_prefill_tokens / spec.cost.prefill_s(spec.max_prefill_tokens)
    network = sim.kv_bytes_per_s / spec.kv_bytes_per_token
    mean_in, mean_out = mean_lengths(sim.wl, m)
    decode = capacity_rps(spec, sim.kv_cap, "decode", mean_in, mean_out) * max(1.0, mean_out)
    sim.pd_velocity[m] = PdVelocity(prefill, network, decode)
    return sim.pd_velocity[m]


def _rate(sim: SimState, m: int, role: str, k: int) -> float:
    series = sim.demand[(m, role)]
    return series[k] if k < len(series) else 0.0


def output_length(sim: SimState, m: int, now: float) -> OutputLength:
    """Finished requests' output tokens over the policy window and since the start, as the operator reads the
    engines' kascade_request_generation_tokens histogram."""
    h = sim.finished[m]
    end = bisect_right(h, now, key=lambda e: e[0])  # finishes up to `now` (the history can be read back later)
    if not end:
        return OutputLength()
    i = bisect_right(h, now - sim.cfg.window_s, key=lambda e: e[0])  # the first finish inside the window
    tok0, n0 = h[i - 1][1:] if i > 0 else (0.0, 0.0)
    tok, n = h[end - 1][1:]
    return OutputLength(tok - tok0, n - n0, tok, n)


def conversion_input(sim: SimState, m: int, k: int) -> ConversionInput:
    """What the operator's pdscaling.conversion_input gives the policy, read from the simulator."""
    v = velocities(sim, m)
    decoders = tuple(DecoderView(d.id, d.convertible, d.n_running + d.incoming)
                     for d in sim.group[(m, "decode")] if d.state == "serving")
    ready = sum(1 for p in sim.group[(m, "prefill")] if p.state == "serving")
    return ConversionInput(_rate(sim, m, "prefill", k), ready, v.prefill_effective, decoders,
                           prefill_queue=float(len(sim.queue[(m, "prefill")])), tbt_slo_s=sim.cfg.tbt_slo_s,
                           ttft_slo_s=sim.cfg.ttft_slo_s, converted_share=measured_share(sim, m))


def measured_share(sim: SimState, m: int) -> float | None:
    """A converted decoder's share of a prefiller as the operator reads it from the engines: the converted
    decoders' mean prefill rate over the serving prefillers' (each measured by `Serving._measure`); None (the
    policy's constant) until both are measured."""
    dec = [r for d in sim.group[(m, "decode")] if d.state == "serving" and d.convertible
           if (r := d.rate.rate()) is not None]
    pre = [r for p in sim.group[(m, "prefill")] if p.state == "serving" if (r := p.rate.rate()) is not None]
    if not dec or not pre:
        return None
    return converted_share(sum(dec) / len(dec), sum(pre) / len(pre))


def apply_conversions(sim: SimState, m: int, k: int, now: float) -> Conversions:
    """One conversion round: the policy's answer applied to the decoders' flags, the chunk budget and the
    hand-back bound; a decoder just converted is offered the prefill queue at once."""
    inp = conversion_input(sim, m, k)
    plan = plan_conversions(inp)
    sim.policy_calls.append((now, "conversion", inp, plan))
    sim.chunk_tokens[m] = plan.chunk_tokens
    sim.hand_back_s[m] = plan.hand_back_s
    by = {d.id: d for d in sim.group[(m, "decode")]}
    for name in plan.convert:
        by[name].convertible = True
        by[name].rate.reset()  # its budgets changed: the engine forgets its rate too
    for name in plan.revert:
        by[name].convertible = False
        by[name].rate.reset()
    if plan.convert:
        sim._wake(m, "prefill", now)
    return plan


def ratio_decisions(sim: SimState, m: int, k: int, now: float,
                    states: dict[str, ScaleState]) -> dict[str, Decision]:
    """Prefill and decode counts from the P:D ratio policy on the window's token rates; `states` carry each
    role's current count and bounds (the decode floor already raised where the simulator needs one)."""
    # decode demand as the operator's (kascade_planner.outputlength): the window's output tokens/s (here the
    # trace's, counted at arrival) or, when larger, arriving requests/s x the recent finished requests' mean length
    rps = sim.rps[m][k] if k < len(sim.rps[m]) else 0.0
    dd = decode_demand(_rate(sim, m, "decode", k), rps, output_length(sim, m, now).mean)
    d = PdDemand(_rate(sim, m, "prefill", k), dd.tokens_per_s, dd.reason)
    v = velocities(sim, m)
    ratio: PdRatio = pd_ratio(d, v, states["prefill"].bounds, states["decode"].bounds)
    sim.policy_calls.append((now, "pdRatio", (d, v, states["prefill"].bounds, states["decode"].bounds,
                                               states["prefill"].current, states["decode"].current), ratio))
    out = {}
    for role, want in (("prefill", ratio.prefill), ("decode", ratio.decode)):
        st = replace(states[role], below_since_s=None)
        out[role] = Decision(role, st.current, want, ratio.reason, (("inputTokensPerSecond", d.input_tokens_per_s),
                                                                     ("outputTokensPerSecond", d.output_tokens_per_s)),
                             st)
    return out
