"""Simulator behaviour: determinism (golden), convergence with infinite bandwidth, no scaling when
one instance is enough, O(1) host cache for Kascade versus ServerlessLLM's per-host caches.

Regenerate the golden file (only after an intended behaviour change):
    .venv/bin/python tests/sim/test_simulator.py --regen
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kascade_sim.generators import synthetic_bursts
from kascade_sim.hardware import EngineCost, hardware, model
from kascade_sim.result import Result
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.traces import read_azure
from kascade_sim.workload import Workload

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden.json"
DYNAMIC = ("kascade", "serverlessllm", "allcache", "lambdascale")


def small_trace() -> Workload:
    return read_azure(DATA / "azure_code_head300.csv").scale_rate(4)


def run(wl: Workload, name: str, hw: str = "a800", hosts: int = 4, gpus: int = 4, **cfg: Any) -> Result:
    return Simulation(wl, hardware(hw, hosts=hosts, gpus_per_host=gpus), model("llama3-8b"), system(name),
                      SimConfig(**cfg)).run()


def fingerprint(r: Result) -> dict[str, Any]:
    s = {k: (round(v, 9) if isinstance(v, float) else v) for k, v in r.summary().items()}
    blob = json.dumps([r.ttft_s, r.tbt_s, [e.__dict__ for e in r.events]], default=repr).encode()
    return {"summary": s, "sha256": hashlib.sha256(blob).hexdigest()}


def golden_now() -> dict[str, Any]:
    wl = small_trace()
    return {name: fingerprint(run(wl, name)) for name in ("kascade", "serverlessllm", "lambdascale")}


def test_same_inputs_same_results_golden() -> None:
    now = golden_now()
    assert now == golden_now()  # twice in one process
    assert now == json.loads(GOLDEN.read_text())  # and the same as when the golden file was written
    assert now["kascade"]["summary"]["scale_ups"] > 0  # the trace really exercises scaling


def test_infinite_bandwidth_every_system_converges() -> None:
    wl = small_trace()
    finite = {n: run(wl, n).summary()["ttft_mean_s"] for n in DYNAMIC}
    inf = {n: run(wl, n, "infinite").summary()["ttft_mean_s"] for n in DYNAMIC}
    assert max(inf.values()) == pytest.approx(min(inf.values()), rel=1e-6)
    # ...while with real links the data path makes a difference (so this test can fail).
    assert max(finite.values()) > 1.1 * min(finite.values())
    assert all(inf[n] <= finite[n] + 1e-9 for n in DYNAMIC)


def test_one_instance_always_enough_no_scale_events() -> None:
    light = synthetic_bursts(120, base_rps=0.5, burst_rps=1.0, burst_every_s=30, burst_len_s=5, seed=1)
    for n in DYNAMIC:
        r = run(light, n)
        assert r.events == ()
        assert r.gpu_seconds == pytest.approx(r.end_s)  # one GPU for the whole run
    heavy = synthetic_bursts(120, base_rps=0.5, burst_rps=40.0, burst_every_s=30, burst_len_s=5, seed=1)
    assert any(e.direction == "up" for e in run(heavy, "kascade").events)


def test_host_cache_is_o1_for_kascade_but_grows_for_serverlessllm() -> None:
    wl = synthetic_bursts(240, base_rps=0.5, burst_rps=90.0, burst_every_s=60, burst_len_s=10, seed=2)
    size = int(model("llama3-8b").params_gb * 1e9)
    touched = {}
    for hosts in (4, 8):
        k = run(wl, "kascade", hosts=hosts, gpus=2)
        s = run(wl, "serverlessllm", hosts=hosts, gpus=2)
        assert k.host_cache_bytes_peak == size
        assert s.host_cache_bytes_peak == s.host_cache_hosts_touched * size
        touched[hosts] = s.host_cache_hosts_touched
    assert touched[8] > touched[4] > 1


def test_engine_cost_calibration_recovers_coefficients() -> None:
    true = EngineCost(0.02, 2e-4, 0.01, 3e-4, 1e-7)
    pre = [(t, true.prefill_s(t)) for t in (128, 1024, 4096)]
    dec = [(b, kv, true.decode_s(b, kv)) for b, kv in ((1, 1000), (8, 20000), (32, 5000), (64, 90000))]
    fit = EngineCost.fit(pre, dec)
    for a, b in zip((fit.p0, fit.p1, fit.d0, fit.d1, fit.d2), (true.p0, true.p1, true.d0, true.d1, true.d2),
                    strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_kascade_loads_faster_than_ssd_misses() -> None:
    wl = small_trace()
    k, s = run(wl, "kascade"), run(wl, "serverlessllm")
    assert k.summary()["mean_predicted_load_s"] < s.summary()["mean_predicted_load_s"]
    assert k.summary()["ttft_mean_s"] < s.summary()["ttft_mean_s"]


def test_disaggregated_mode_scales_prefill_and_decode_separately() -> None:
    wl = synthetic_bursts(120, base_rps=1, burst_rps=25, burst_every_s=40, burst_len_s=8, input_tokens=1024,
                          output_tokens=256, seed=4)
    r = run(wl, "kascade", mode="disaggregated")
    roles = {e.role for e in r.events if e.direction == "up"}
    assert roles == {"prefill", "decode"}
    assert all(t == t and t >= 0 for t in r.ttft_s)  # every request got its first token
    assert sum(1 for b in r.tbt_s if b == b) == sum(1 for q in wl.requests if q.output_tokens > 1)
    # Decoding apart from prefill removes prefill stalls from TBT (without convertible decoders, whose
    # converted prefill chunks stall decodes again by design: at most the policy's chunk budget per step).
    plain = Simulation(wl, hardware("a800", hosts=4, gpus_per_host=4), model("llama3-8b"),
                       system("kascade", convertible=False), SimConfig(mode="disaggregated")).run()
    assert plain.summary()["tbt_p99_s"] < run(wl, "kascade").summary()["tbt_p99_s"]
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="split")


if __name__ == "__main__" and "--regen" in sys.argv:
    GOLDEN.write_text(json.dumps(golden_now(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
