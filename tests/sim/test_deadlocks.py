"""Deadlocks the simulator once had, each replayed in the shape that triggered it, and what an unfinished run
reports. Each run must finish every request; before the fixes each raised (issue 39).

(a) Prefillers holding KV took every GPU while their models had no decoder: 4 models on 4 instance slots (72B at
    tp=4 on 2x8 GPUs), disaggregated. An idle decoder was preempted for another model's prefiller, and initial
    counts could give a model a prefiller without a decoder; every baseline deadlocked too.
(b) A prompt a converted decoder handed back waited for a prefiller that was never started: `_instances_for`
    counted the model's decoders as prefill instances although none would take it (README's command with
    `--scale-down-delay 0.5 --tick 0.25`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner

from kascade_cli.sim import sim
from kascade_planner.policies import Threshold
from kascade_sim.generators import burstgpt_like
from kascade_sim.hardware import hardware, model
from kascade_sim.simulator import SimConfig, Simulation, SimulationStalled
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload

CFG = SimConfig(mode="disaggregated", min_instances=0, tick_s=0.25, policy=Threshold(4.0, 0.3, 0.5, "queueLength"),
                decode_policy=Threshold(0.8, 0.3, 0.5, "kvCacheUsage"))


@pytest.mark.parametrize(("name", "rate", "seed"), [("allcache", 0.8, 2), ("serverlessllm", 0.8, 1),
                                                    ("lambdascale", 0.8, 1), ("kascade", 2.0, 2)])
def test_four_models_on_four_slots_finish(name: str, rate: float, seed: int) -> None:
    wl = burstgpt_like(300.0, rate, models=4, seed=seed)
    s = Simulation(wl, hardware("cluster-a", hosts=2, gpus_per_host=8), model("qwen-72b"), system(name), CFG)
    r = s.run()
    assert r.requests == len(wl.requests) and s.unfinished == 0
    # no prefiller ever ran for a model without a decoder at the end: every prefilled request reached one
    assert all(x > 0 for x in r.ttft_s) and all(x >= 0 for x in r.tbt_s)


def test_readme_command_with_fast_scale_down_finishes(tmp_path: Path) -> None:
    """(b) in the shape that triggered it: README's paper-setting command, sub-second scale-down."""
    out = tmp_path / "r.json"
    res = CliRunner().invoke(sim, ["burstgpt-like", "--model", "qwen-72b", "--mode", "disaggregated", "--models", "4",
                                   "--host-mem-gb", "300", "--min-instances", "0", "--rate", "0.8", "--duration", "600",
                                   "--scale-down-delay", "0.5", "--tick", "0.25", "-s", "kascade", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["systems"]["kascade"]["requests"] > 1000


def test_a_handed_back_prompt_is_not_counted_as_served_by_decoders() -> None:
    """(b) at its cause: with a handed-back prompt at the head of the prefill queue, the decoders (which will not
    take it) are not prefill instances for the policy, so the threshold policy starts a prefiller."""
    wl = Workload("two", (Request(0.0, 4096, 400), Request(0.1, 64, 8)))
    s = Simulation(wl, hardware("a800", hosts=1, gpus_per_host=4), model("llama3-8b"), system("kascade"), CFG)
    d = s._new_instance("host-0", 0, "decode", 0.0, "serving")
    s.queue[(0, "prefill")].append(0)
    assert s._instances_for(0, "prefill") == 1  # an idle decoder takes any prompt: it counts
    s.handed.add(0)
    assert s._instances_for(0, "prefill") == 0 and s._convertible(0, "prefill") == 0
    assert d.state == "serving"


@contextlib.contextmanager
def idle_policy() -> Iterator[None]:
    """No instance at the start and a policy that never scales: every request is left waiting."""
    with mock.patch.object(Simulation, "_tick", lambda self, now, k: None), \
            mock.patch.object(Simulation, "_initial_counts", lambda self: {}):
        yield


def test_an_unfinished_run_names_the_stuck_requests() -> None:
    wl = Workload("two", (Request(0.0, 64, 8), Request(1.0, 64, 8)))
    s = Simulation(wl, hardware("a800", hosts=1, gpus_per_host=4), model("llama3-8b"), system("allcache"),
                   SimConfig(min_instances=0))
    with idle_policy(), pytest.raises(SimulationStalled) as e:
        s.run()
    assert e.value.stuck == [(0, 0, 0.0, "waits in the colocated queue"), (1, 0, 1.0, "waits in the colocated queue")]
    assert "request 0 (model 0, arrived 0.000 s) waits in the colocated queue" in str(e.value)


def test_kascade_sim_reports_a_stall_in_one_line(tmp_path: Path) -> None:
    with idle_policy():
        res = CliRunner().invoke(sim, ["burstgpt-like", "--duration", "30", "--min-instances", "0", "-s", "allcache",
                                       "--hosts", "1", "--gpus-per-host", "4", "-o", str(tmp_path / "r.json")])
    assert res.exit_code == 1 and res.exception is not None and isinstance(res.exception, SystemExit), res.output
    assert "Error: simulation of allcache stalled with" in res.output and "Traceback" not in res.output
    assert "waits in the colocated queue" in res.output
