"""The shared fleet in the simulator (issue 35): the planner's arbitration every tick, preemption of an idle
model's replicas for a bursting one, priorities, and the fleet-versus-per-model-pools comparison."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import kascade_planner.arbitration as arbitration
from kascade_planner.policies import Threshold
from kascade_sim import arbiter
from kascade_sim.fleet import fleet_comparison, partition, peak_gpus
from kascade_sim.hardware import hardware, model
from kascade_sim.instance import Instance
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload

CFG = SimConfig(tick_s=0.25, min_instances=0, policy=Threshold(4.0, 0.3, 0.5, "queueLength"), arbitration=True,
                hysteresis_s=2.0)


def two_bursts() -> Workload:
    """Model 0 bursts in [0, 6) s, model 1 in [20, 26) s; a trickle of each in between."""
    reqs = [Request(0.02 * k, 1024, 4, 0) for k in range(300)] + [Request(20 + 0.02 * k, 1024, 4, 1)
                                                                   for k in range(300)]
    reqs += [Request(8.0 + 2.0 * k, 64, 2, k % 2) for k in range(6)]
    return Workload("two-bursts", tuple(sorted(reqs, key=lambda r: (r.arrival_s, r.model))))


def test_the_simulator_arbitrates_with_the_planners_function(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = arbitration.arbitrate

    def spy(*a: Any, **kw: Any) -> arbitration.Arbitration:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(arbiter, "arbitrate", spy)
    Simulation(two_bursts(), hardware("a800", hosts=1, gpus_per_host=4), model("llama3-8b"), system("kascade"),
               CFG).run()
    assert len(calls) > 50


def test_a_burst_takes_the_gpus_another_model_is_not_using() -> None:
    s = Simulation(two_bursts(), hardware("a800", hosts=1, gpus_per_host=4), model("llama3-8b"), system("kascade"),
                   CFG)
    r = s.run()
    assert all(t == t for t in r.ttft_s)
    # each model's burst ran on (nearly) the whole node in turn: 4 GPUs for model 0, then for model 1
    for m, (t0, t1) in ((0, (0.0, 6.0)), (1, (20.0, 26.0))):
        mine = [i for i in s.instances if i.model == m and i.alloc_s < t1]
        assert peak_gpus([i for i in mine if i.alloc_s >= t0 - 1]) >= 3, m


def test_preemption_reason_and_priority_class() -> None:
    # both models busy at once on 2 GPUs; model 1 has the higher priority class: it ends up with the node
    reqs = [Request(0.01 * k, 1024, 4, k % 2) for k in range(800)]
    wl = Workload("both", tuple(reqs))
    hw = hardware("a800", hosts=1, gpus_per_host=2)
    s = Simulation(wl, hw, model("llama3-8b"), system("kascade"), replace(CFG, priorities=(0, 5)))
    s.run()
    assert s.short_reasons.get(0) and "priority 0" in s.short_reasons[0][-1][1]
    # model 1 waits only while model 0's replica is within its hysteresis (bound at 0 s), then takes it
    assert all(t < CFG.hysteresis_s for t, _ in s.short_reasons.get(1, [])), s.short_reasons[1][-1]
    pre = [e for e in s.events if e.direction == "down" and "preempted for 1" in e.reason]
    assert pre and pre[0].model == 0 and pre[0].time_s >= CFG.hysteresis_s and "priority 5 above 0" in pre[0].reason


def test_fleet_comparison_on_two_bursts() -> None:
    out = fleet_comparison(two_bursts(), hardware("a800", hosts=2, gpus_per_host=2), model("llama3-8b"), CFG)
    runs = out["runs"]
    assert set(runs) == {"kascade-fleet", "kascade-per-model-pools", "kascade-equal-pools", "serverlessllm-fleet",
                         "allcache-fleet"}
    assert "simulated" in out["simulated"]
    # bursts that do not coincide: one fleet of 4 GPUs holds less than two pools each sized for its own peak
    assert runs["kascade-fleet"]["peak_gpus"] < runs["kascade-per-model-pools"]["peak_gpus"]
    assert out["fleet_gpu_time_over_per_model_pools"] < 1.0
    # and an equal split (2 GPUs per model) is slower on each burst
    assert runs["kascade-fleet"]["ttft_mean_s"] < runs["kascade-equal-pools"]["ttft_mean_s"]


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="models"):
        partition(hardware("a800", hosts=3, gpus_per_host=1), 2)
    with pytest.raises(ValueError, match="arbitration"):
        SimConfig(arbitration=True, mode="disaggregated")
    with pytest.raises(ValueError, match="models"):
        fleet_comparison(Workload("one", (Request(0.0, 8, 2),)), hardware("a800"), model("llama3-8b"), CFG)


def test_peak_gpus_counts_a_release_before_a_bind_at_one_instant() -> None:
    a = Instance("a", "n", 1, 0.0, 100, 0, "colocated", "serving")
    b = Instance("b", "n", 1, 5.0, 100, 0, "colocated", "serving")
    a.released_s = 5.0
    assert peak_gpus([a, b]) == 1


def test_no_replica_is_preempted_within_the_hysteresis_unless_for_a_model_with_none() -> None:
    # model 0 steady on every GPU, model 1 bursting three times: GPUs move both ways
    reqs = [Request(0.05 * k, 1024, 4, 0) for k in range(1200)]
    reqs += [Request(b + 0.02 * k, 1024, 4, 1) for b in (10, 25, 40) for k in range(150)]
    wl = Workload("mix", tuple(sorted(reqs, key=lambda r: (r.arrival_s, r.model))))
    cfg = replace(CFG, hysteresis_s=15.0)
    s = Simulation(wl, hardware("a800", hosts=1, gpus_per_host=4), model("llama3-8b"), system("kascade"), cfg)
    s.run()
    by_id = {i.id: i for i in s.instances}
    pre = [e for e in s.events if e.direction == "down" and " preempted for " in e.reason]
    assert len(pre) >= 4 and s.preemptions == len(pre)
    assert {e.model for e in pre} == {0, 1}  # both ways
    for e in pre:
        victim = by_id[e.reason.split(" ", 1)[0]]
        # a replica bound within the hysteresis goes only to a model holding none, by fair share or class
        assert e.time_s - victim.alloc_s >= cfg.hysteresis_s or "fair share" in e.reason, e
    # no ping-pong on SLO pressure: a model does not take back, within the hysteresis, what it just lost
    for e in pre:
        taker = int(e.reason.split(" preempted for ", 1)[1].split(":", 1)[0])
        assert not any(0 <= f.time_s - e.time_s < cfg.hysteresis_s and f.model == taker and "SLO pressure" in f.reason
                       and f" preempted for {e.model}:" in f.reason for f in pre), e
