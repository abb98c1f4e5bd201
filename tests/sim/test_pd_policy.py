"""The simulator's disaggregated decisions are the operator's policies' answers (kascade_sim.pdpolicy):
the P:D ratio (kascade_planner.pdratio.pd_ratio) and the convertible decoders
(kascade_planner.conversion.plan_conversions). Every policy call the simulator made is logged with its
input; each test calls the policy again on that input and checks the simulator's answer and what it then
did (the decoders' flags the next round saw, the chunk budget the converted decoders used, the scale
events) against it. A second implementation of a rule inside the simulator, or an answer applied
differently, fails here."""

from __future__ import annotations

import random

import pytest

import kascade_sim.pdpolicy as pdpolicy
from kascade_planner import conversion, pdratio
from kascade_planner.conversion import ConversionInput, Conversions
from kascade_planner.pdratio import PdRatio
from kascade_sim.hardware import hardware, model
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload

SPEC = model("llama3-8b")


def burst_trace(seed: int = 3) -> Workload:
    """Short prompts all along, long ones in a burst from 2 s to 4 s (the bench's shape, GPU speeds)."""
    rng = random.Random(seed)
    reqs = [Request(rng.uniform(0, 8), rng.randint(16, 48), 32) for _ in range(60)]
    reqs += [Request(rng.uniform(2, 4), rng.randint(300, 420), 32) for _ in range(120)]
    return Workload("burst", tuple(sorted(reqs, key=lambda r: r.arrival_s)))


def run(cfg: SimConfig, convertible: bool = True, gpus: int = 2) -> Simulation:
    s = Simulation(burst_trace(), hardware("a800", hosts=1, gpus_per_host=gpus), SPEC,
                   system("kascade", convertible=convertible), cfg)
    s.run()
    return s


FIXED = SimConfig(mode="disaggregated", min_instances=1, max_instances=1, tick_s=0.05, window_s=0.2,
                  ttft_slo_s=0.3, tbt_slo_s=0.04)


def test_the_simulator_calls_the_planners_functions() -> None:
    assert pdpolicy.plan_conversions is conversion.plan_conversions
    assert pdpolicy.pd_ratio is pdratio.pd_ratio


def test_conversions_are_the_policys_answers_and_applied_as_answered() -> None:
    s = run(FIXED)
    calls = [(t, i, a) for t, kind, i, a in s.policy_calls if kind == "conversion"]
    assert calls, "no conversion round ran"
    assert any(isinstance(a, Conversions) and a.convert for _, _, a in calls)  # the burst converted a decoder
    assert any(isinstance(a, Conversions) and a.revert for _, _, a in calls)  # ... and it was taken back
    flags: dict[str, bool] = {}
    for _, inp, ans in calls:
        assert isinstance(inp, ConversionInput) and isinstance(ans, Conversions)
        # the state the simulator offered is what the previous answers left
        for d in inp.decoders:
            assert d.converted == flags.get(d.name, False), (d, flags)
        assert conversion.plan_conversions(inp) == ans
        flags.update(dict.fromkeys(ans.convert, True))
        flags.update(dict.fromkeys(ans.revert, False))
    # the chunk budget the converted decoders used is the policy's
    assert s.chunk_tokens[0] == calls[-1][2].chunk_tokens
    assert s.converted_prefills > 0


def test_conversion_input_is_the_simulators_state() -> None:
    s = run(FIXED)
    for _, kind, inp, _ in s.policy_calls:
        if kind != "conversion":
            continue
        assert isinstance(inp, ConversionInput)
        v = pdpolicy.velocities(s, 0)
        assert inp.prefill_tokens_per_s == v.prefill_effective
        assert inp.prefill_ready <= 1 and len(inp.decoders) <= 1  # min = max = 1 per role
        assert inp.tbt_slo_s == FIXED.tbt_slo_s


def test_pd_ratio_counts_are_the_policys_and_scale_the_roles() -> None:
    cfg = SimConfig(mode="disaggregated", pd_policy="tokenVelocity", min_instances=1, max_instances=3,
                    tick_s=0.05, window_s=0.2)
    s = run(cfg, convertible=False, gpus=8)
    calls = [(t, i, a) for t, kind, i, a in s.policy_calls if kind == "pdRatio"]
    assert calls
    for t, inp, ans in calls:
        d, v, pb, db, cur_p, cur_d = inp  # type: ignore[misc]
        assert isinstance(ans, PdRatio)
        assert pdratio.pd_ratio(d, v, pb, db) == ans
        # the scale events of this tick take each role from its current count to the answer's (8 GPUs: room
        # for 3 + 3; a scale-down releases only instances that may go now, so it may stop short), and carry
        # this answer's reason (no other rule scaled)
        now = [e for e in s.events if e.time_s == t]
        for role, cur, want in (("prefill", cur_p, ans.prefill), ("decode", cur_d, ans.decode)):
            moved = sum(e.count if e.direction == "up" else -e.count for e in now if e.role == role)
            ok = cur + moved == want if want >= cur else want <= cur + moved <= cur
            assert ok, (t, role, cur, moved, want)
        assert all(e.reason == ans.reason for e in now), [(e.reason, ans.reason) for e in now]
    ups = {e.role for e in s.events if e.direction == "up"}
    assert "prefill" in ups, [e.reason for e in s.events]  # the burst asked for more prefillers
    assert any(a.prefill > 1 for _, _, a in calls if isinstance(a, PdRatio))


def test_pd_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="pd_policy"):
        SimConfig(pd_policy="ratio")


def bench_shape(seed: int, k: float = 6.0) -> Workload:
    """bench/pd.py's trace shape, time-compressed by k: short prompts at 1.5/s for 40 s, long ones (300-420
    tokens) for 12 s from 10 s at 1.2 x one prefiller's velocity."""
    rng = random.Random(seed)
    v = 420 / SPEC.cost.prefill_s(420)
    out: list[Request] = []
    for rate, start, span, (lo, hi) in ((1.5 * k, 0.0, 40 / k, (16, 48)), (1.2 * v / 360, 10 / k, 12 / k, (300, 420))):
        t = start + rng.expovariate(rate)
        while t < start + span:
            out.append(Request(t, rng.randint(lo, hi), 32))
            t += rng.expovariate(rate)
    return Workload("bench-shape", tuple(sorted(out, key=lambda r: r.arrival_s)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bench_shape_direction(seed: int) -> None:
    """On the bench's trace shape with the bench's SLO rule (5 x unloaded TTFT, 3 x unloaded TBT) and its
    fixed instances (2 colocated, or 1 prefill + 1 decode): colocated loses TBT (prefill stalls decodes),
    disaggregated loses TTFT (one prefiller under the burst), convertible decoders recover TTFT and keep TBT."""
    ttft_slo, tbt_slo = 5 * SPEC.cost.prefill_s(420), 3 * SPEC.cost.decode_s(1, 420)
    att = {}
    for name, n, mode, conv in (("colocated", 2, "colocated", False), ("disaggregated", 1, "disaggregated", False),
                                ("convertible", 1, "disaggregated", True)):
        cfg = SimConfig(mode=mode, min_instances=n, max_instances=n, tick_s=0.25 / 6, window_s=1 / 6,
                        ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo)
        r = Simulation(bench_shape(seed), hardware("a800", hosts=1, gpus_per_host=2), SPEC,
                       system("kascade", convertible=conv), cfg).run()
        att[name] = (sum(t <= ttft_slo for t in r.ttft_s) / r.requests,
                     sum(b != b or b <= tbt_slo for b in r.tbt_s) / r.requests)
    assert att["colocated"][1] < att["disaggregated"][1], att
    assert att["disaggregated"][0] < att["convertible"][0], att
    assert att["convertible"][1] >= att["colocated"][1] and att["convertible"][1] >= 0.99, att


def test_decode_demand_is_the_operators_with_the_finished_requests_estimate() -> None:
    """The P:D ratio's decode demand is kascade_planner.outputlength's, as the operator's: max(the window's output
    tokens/s, arriving requests/s x the mean output of the requests finished in the window, else since the start)."""
    from kascade_planner.outputlength import decode_demand

    cfg = SimConfig(mode="disaggregated", pd_policy="tokenVelocity", min_instances=1, max_instances=3,
                    tick_s=0.05, window_s=0.2)
    s = run(cfg, convertible=False, gpus=8)
    calls = [(t, i) for t, kind, i, _ in s.policy_calls if kind == "pdRatio"]
    assert calls
    estimated = 0
    for t, inp in calls:
        d = inp[0]  # type: ignore[index]
        k = round(t / cfg.tick_s) - 1  # the TICK event k runs at (k + 1) * tick_s
        length = pdpolicy.output_length(s, 0, t)
        out, rps = (x[k] if k < len(x) else 0.0 for x in (s.demand[(0, "decode")], s.rps[0]))  # 0 after the trace
        want = decode_demand(out, rps, length.mean)
        assert d.output_tokens_per_s == pytest.approx(want.tokens_per_s) and d.output_note == want.reason
        estimated += length.mean is not None
    assert estimated, "no finished request ever gave an estimate"
    assert pdpolicy.output_length(s, 0, calls[-1][0]).mean == pytest.approx(32.0)  # every request generates 32
