"""Simulator fidelity fixes (issue 19), each a test that fails on the simulator before them: one-to-one
live pairs with bounded partner debt, a global queue that redirects backlog, ServerlessLLM's host
cache warm only after its SSD load, decode within KV capacity, no start-up crashes in disaggregated
or big-model settings, no spurious scale-ups from the first window, BlitzScale's cluster B preset,
and several models sharing host DRAM under a budget."""

from __future__ import annotations

from typing import Any

import pytest

from kascade_planner.policies import Threshold
from kascade_sim.generators import constant, synthetic_bursts
from kascade_sim.hardware import hardware, model
from kascade_sim.hostmem import HostMemory
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload


def sim(wl: Workload, name: str, hw: Any = None, spec: Any = None, **cfg: Any) -> Simulation:
    return Simulation(wl, hw or hardware("a800", hosts=2, gpus_per_host=4), spec or model("llama3-8b"), system(name),
                      SimConfig(**cfg))


def burst(seed: int = 5) -> Workload:
    return synthetic_bursts(90, base_rps=1, burst_rps=40, burst_every_s=30, burst_len_s=6, input_tokens=2048,
                            output_tokens=64, seed=seed)


def test_live_pairs_are_one_to_one_and_partner_debt_is_bounded() -> None:
    s = sim(burst(), "kascade")
    s.run()
    assert s.pairings, "the burst must cause live scale-ups"
    busy: dict[str, float] = {}
    for t, partner, _target, ready in sorted(s.pairings):
        assert busy.get(partner, -1.0) <= t, f"{partner} paired again before its live target was ready"
        busy[partner] = ready
    # A partner owes at most one iteration of its target's layers (the longest is one full prefill batch).
    longest = s.spec.cost.prefill_s(max(s.spec.max_prefill_tokens, max(s.inp)))
    assert 0 < s.max_debt_s <= longest


def test_backlog_is_redirected_to_instances_started_after_it_arrived() -> None:
    s = sim(burst(), "allcache")
    s.run()
    alloc = {i.id: i.alloc_s for i in s.instances}
    late = sum(1 for r, who in enumerate(s.served_by) if alloc[who] > s.arr[r])
    assert late >= 3  # requests queued before their instance existed were served by it


def test_serverlessllm_host_copy_is_warm_only_after_its_ssd_load() -> None:
    s = sim(burst(), "serverlessllm", hardware("a800", hosts=2, gpus_per_host=2))
    s.hostmem.loaded("host-0", 0, 0.0)  # what run() does for the instance present at the start
    s._new_instance("host-0", 0, "colocated", 0.0, "serving")
    for t in (0.0, 1.0, 2.0):
        s._now = t
        s._scale_up(t, 0, "colocated", 1, "test")
    loaded = [i for i in s.instances if i.alloc_s >= 0 and i.state == "loading"]
    assert [(i.node, i.from_ssd) for i in loaded] == [("host-0", False), ("host-1", True), ("host-1", True)]
    assert (s.hostmem.hits, s.hostmem.misses) == (1, 2)
    assert loaded[1].ready_s > 2.0  # still reading the SSD when the third load was planned


def test_host_memory_lru_and_keep_alive() -> None:
    hm = HostMemory(["h"], budget_bytes=2e9, model_bytes=int(1e9), keep_alive_s=10.0)
    hm.loaded("h", 0, 0.0)
    hm.loaded("h", 1, 1.0)
    hm.released("h", 0, 2.0)
    hm.released("h", 1, 3.0)
    assert hm.lookup("h", 0, 4.0)  # touched: model 1 is now the least recently used
    hm.loaded("h", 2, 5.0)
    assert hm.warm("h", 0, 5.0) and not hm.warm("h", 1, 5.0) and hm.evictions == 1
    assert not hm.warm("h", 0, 12.5)  # unused since 2 s + 10 s keep-alive
    assert hm.miss_rate == 0.0 and not hm.lookup("h", 1, 13.0) and hm.miss_rate == 0.5


def test_decode_never_admits_past_its_kv_capacity() -> None:
    hw = hardware("a800", hosts=2, gpus_per_host=4, gpu_mem_gb=17.0)  # ~6,800 KV tokens per instance
    wl = synthetic_bursts(60, base_rps=4, burst_rps=30, burst_every_s=20, burst_len_s=5, input_tokens=1024,
                          output_tokens=256, seed=2)
    for name in ("kascade", "static-peak"):
        r = sim(wl, name, hw, mode="disaggregated").run()
        assert 0.5 < r.kv_peak_fraction <= 1.0
        assert r.requests == len(wl.requests) and all(t == t for t in r.ttft_s)


@pytest.mark.parametrize("preset", ["mistral-24b", "qwen-72b"])
def test_big_models_and_long_prompts_start_in_every_mode(preset: str) -> None:
    wl = Workload("long", tuple(Request(0.2 * k, 30000 if k % 3 == 0 else 3000, 200) for k in range(60)))
    for mode in ("colocated", "disaggregated"):
        for name in ("kascade", "serverlessllm", "static-peak", "static-average"):
            r = sim(wl, name, hardware("a800"), model(preset), mode=mode).run()
            assert all(t == t and t > 0 for t in r.ttft_s), (preset, mode, name)


def test_constant_load_causes_no_scaling_from_the_first_window() -> None:
    wl = constant(60, rate_rps=6.0, input_tokens=1024, output_tokens=64)
    for cfg in ({}, {"policy": Threshold(3000.0, 1000.0, 5.0)}):
        r = sim(wl, "kascade", hardware("a800", hosts=2, gpus_per_host=4), **cfg).run()
        assert r.events == (), [e.reason for e in r.events]
        assert r.gpu_seconds > 1.5 * r.end_s  # it did start with more than one instance


def test_a100_preset_is_blitzscale_cluster_b() -> None:
    b = hardware("a100")
    assert (b.hosts, b.gpus_per_host, b.gpu_mem_gb, b.pcie_gbps) == (2, 8, 80.0, 256.0)
    assert b.nvlink_gbps == b.pcie_gbps  # no NVLink: GPUs of one host talk over PCIe
    assert hardware("cluster-b") == hardware("a100", name="cluster-b")
    a = hardware("cluster-a")
    assert (a.hosts, a.gpus_per_host, a.rdma_gbps, a.nvlink_gbps, a.pcie_gbps, a.ssd_gbps) == (4, 8, 100, 1600, 128, 10)


def test_models_share_host_memory_and_serverlessllm_misses_under_a_budget() -> None:
    wl = burst().for_models(4)
    roomy = sim(wl, "serverlessllm", hardware("a800", hosts=2, gpus_per_host=4)).run()
    tight = sim(wl, "serverlessllm", hardware("a800", hosts=2, gpus_per_host=4, host_mem_gb=20)).run()
    assert roomy.models == tight.models == 4
    assert tight.host_cache_miss_rate >= roomy.host_cache_miss_rate > 0
    assert roomy.host_cache_evictions == 0 < tight.host_cache_evictions
    assert tight.host_cache_bytes_peak <= 2 * 16e9 < roomy.host_cache_bytes_peak  # one 16 GB copy per host fits
    k = sim(wl, "kascade", hardware("a800", hosts=2, gpus_per_host=4, host_mem_gb=20)).run()
    assert k.host_cache_bytes_peak == 4 * 16e9  # one pool copy per model, whatever the hosts


def test_policy_queue_length_and_decode_prescaled_with_prefill() -> None:
    from kascade_planner.policies import Bounds, MetricsSnapshot, ScaleState, prescale_decode, threshold

    q = Threshold(4.0, 0.3, 0.5, "queueLength")
    st = ScaleState("prefill", 2, Bounds(0, 8), True)
    up = threshold(MetricsSnapshot(1.0, in_flight=17), st, q)
    assert up.desired == 5  # ceil(17 / 4)
    assert threshold(MetricsSnapshot(1.0, in_flight=2), st, q).change == 0
    dec = threshold(MetricsSnapshot(1.0, kv_usage=0.5), ScaleState("decode", 1, Bounds(0, 8), True),
                    Threshold(0.8, 0.3, 0.5, "kvCacheUsage"))
    assert prescale_decode(up, dec, 0.5).desired == 2  # +3 prefillers at 0.5 -> one more decoder
    one = threshold(MetricsSnapshot(1.0, in_flight=9), ScaleState("prefill", 2, Bounds(0, 8), True), q)
    assert one.change == 1 and prescale_decode(one, dec, 0.5) == dec  # half a decoder is none
    with pytest.raises(ValueError, match="metric"):
        Threshold(1.0, 0.5, 1.0, "queue")
