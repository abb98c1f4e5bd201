"""Physical sanity of the simulator as properties over small random settings (hypothesis): infinite
bandwidth makes every system converge, more bandwidth never makes a system slower (within one
batch), a constant load causes no scaling, KV usage never exceeds capacity, GPU time never falls
below what the offered load needs, and no preset x mode x system combination crashes.

CI runs 8 derandomized examples per property (reproducible); a deeper random search:
    KASCADE_SIM_RANDOM=1 KASCADE_SIM_EXAMPLES=60 pytest tests/sim/test_properties.py   (passed, ~50 s)
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kascade_sim.generators import constant, synthetic_bursts
from kascade_sim.hardware import HARDWARE_PRESETS, MODEL_PRESETS, hardware, model
from kascade_sim.result import Result
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import SYSTEM_NAMES, system
from kascade_sim.workload import Request, Workload

DYNAMIC = ("kascade", "serverlessllm", "allcache", "lambdascale")
FAST = settings(
    max_examples=int(os.environ.get("KASCADE_SIM_EXAMPLES", "8")),
    deadline=None,
    derandomize=os.environ.get("KASCADE_SIM_RANDOM") is None,
    suppress_health_check=[HealthCheck.too_slow],
)

bursts = st.builds(lambda seed, base, peak, every, inp, out: synthetic_bursts(
    30, base, peak, every, every / 4, input_tokens=inp, output_tokens=out, seed=seed),
    st.integers(0, 10_000), st.floats(0.2, 2.0), st.floats(5.0, 40.0), st.floats(8.0, 20.0),
    st.sampled_from([256, 1024, 4096]), st.sampled_from([16, 64, 200]))
clusters = st.tuples(st.integers(1, 3), st.sampled_from([2, 4]))
modes = st.sampled_from(["colocated", "disaggregated"])


def run(wl: Workload, name: str, hosts: int, gpus: int, hw: str = "a800", mode: str = "colocated",
        convertible: bool | None = None, **links: float) -> Result:
    sys = system(name) if convertible is None else system(name, convertible=convertible)
    return Simulation(wl, hardware(hw, hosts=hosts, gpus_per_host=gpus, **links), model("llama3-8b"), sys,
                      SimConfig(mode=mode)).run()


def mean_ttft(r: Result) -> float:
    return sum(r.ttft_s) / len(r.ttft_s)


@FAST
@given(bursts, clusters, modes)
def test_infinite_bandwidth_makes_every_system_converge(wl: Workload, cluster: tuple[int, int], mode: str) -> None:
    # Convertible decoders are how Kascade serves, not how weights move: compared without them.
    ttft = {n: run(wl, n, *cluster, hw="infinite", mode=mode, convertible=False).ttft_s for n in DYNAMIC}
    ref = ttft["kascade"]
    for n, t in ttft.items():
        assert all(abs(a - b) <= 1e-6 * max(1.0, b) for a, b in zip(t, ref, strict=True)), n


@FAST
@given(bursts, clusters, st.sampled_from(DYNAMIC), st.floats(25.0, 200.0))
def test_more_bandwidth_is_never_slower_beyond_one_batch(wl: Workload, cluster: tuple[int, int], name: str,
                                                         gbps: float) -> None:
    slow = run(wl, name, *cluster, rdma_gbps=gbps, pcie_gbps=gbps, ssd_gbps=gbps / 10)
    fast = run(wl, name, *cluster, rdma_gbps=2 * gbps, pcie_gbps=2 * gbps, ssd_gbps=gbps / 5)
    spec = model("llama3-8b")
    batch = spec.cost.prefill_s(spec.max_prefill_tokens)
    assert mean_ttft(fast) <= mean_ttft(slow) + batch


@FAST
@given(st.floats(0.5, 12.0), st.sampled_from([128, 512, 2048]), st.sampled_from([8, 32, 128]), clusters,
       st.sampled_from(DYNAMIC))
def test_constant_load_causes_no_scaling(rate: float, inp: int, out: int, cluster: tuple[int, int], name: str) -> None:
    wl = constant(40, rate, inp, out)
    r = run(wl, name, *cluster)
    assert r.events == (), [(e.time_s, e.reason) for e in r.events]


@FAST
@given(bursts, clusters, modes, st.sampled_from((*DYNAMIC, "static-peak")), st.floats(16.5, 20.0))
def test_kv_usage_never_exceeds_capacity(wl: Workload, cluster: tuple[int, int], mode: str, name: str,
                                         gpu_gb: float) -> None:
    r = run(wl, name, *cluster, mode=mode, gpu_mem_gb=gpu_gb)  # a few thousand KV tokens per instance
    assert 0 < r.kv_peak_fraction <= 1.0


@FAST
@given(bursts, clusters, modes, st.sampled_from((*DYNAMIC, "static-peak", "static-average")))
def test_gpu_time_covers_the_offered_load(wl: Workload, cluster: tuple[int, int], mode: str, name: str) -> None:
    sim = Simulation(wl, hardware("a800", hosts=cluster[0], gpus_per_host=cluster[1]), model("llama3-8b"),
                     system(name), SimConfig(mode=mode))
    r = sim.run()
    c, spec = sim.spec.cost, sim.spec
    # An iteration of T prompt tokens takes >= p1*T; a decode step of B sequences >= B*(d1 + d0/max_batch).
    need = spec.tp * sum(
        c.p1 * i + (c.d1 + c.d0 / spec.max_batch) * (o - 1) for i, o in zip(sim.inp, sim.out, strict=True)
    )
    assert r.gpu_seconds >= need > 0


def test_no_preset_mode_system_combination_crashes() -> None:
    reqs = tuple(Request(0.5 * k, 20000 if k % 7 == 0 else 300 + 50 * k, 1 + (k * 37) % 120, k % 2) for k in range(20))
    wl = Workload("mixed", reqs)
    for hw in HARDWARE_PRESETS:
        for m in MODEL_PRESETS:
            for mode in ("colocated", "disaggregated"):
                for name in SYSTEM_NAMES:
                    r = Simulation(wl, hardware(hw), model(m), system(name), SimConfig(mode=mode)).run()
                    assert r.requests == 20 and all(t == t and t > 0 for t in r.ttft_s), (hw, m, mode, name)
    small = replace(hardware("a100"), gpus_per_host=4)  # two 72B instances for two models x two roles: a clear error
    with pytest.raises(ValueError, match="room for 2 instances but 4 model/role groups"):
        Simulation(wl, small, model("qwen-72b"), system("kascade"), SimConfig(mode="disaggregated")).run()
