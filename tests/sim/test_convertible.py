"""Convertible decoders (TokenScale), Kascade's serving in disaggregated mode: a decoder prefills its own
model's short prompts when no prefiller is idle, so a trickle of requests needs no prefiller loaded for
each one (the paper setting's GPU time: most prefill scale-ups were 'traffic with no instance'). Each
test fails without the feature (`convertible=False`)."""

from __future__ import annotations

from kascade_planner.policies import Threshold
from kascade_sim.hardware import hardware, model
from kascade_sim.result import Result
from kascade_sim.simulator import SimConfig, Simulation
from kascade_sim.systems import system
from kascade_sim.workload import Request, Workload

CFG = SimConfig(mode="disaggregated", min_instances=0, tick_s=0.25, policy=Threshold(4.0, 0.3, 0.5, "queueLength"),
                decode_policy=Threshold(0.8, 0.3, 0.5, "kvCacheUsage"))
SPEC = model("llama3-8b")


def trickle(inp: int) -> Workload:
    # One request every 3 s, each decoding ~400 tokens (~5 s): a decoder is always busy, prefill rarely.
    return Workload("trickle", tuple(Request(3.0 * k, inp, 400) for k in range(40)))


def run(wl: Workload, convertible: bool) -> tuple[Simulation, Result]:
    s = Simulation(wl, hardware("a800", hosts=1, gpus_per_host=4), SPEC, system("kascade", convertible=convertible), CFG)
    return s, s.run()


def prefill_ups(r: Result) -> int:
    return sum(e.count for e in r.events if e.direction == "up" and e.role == "prefill")


def test_a_decoder_prefills_a_trickle_instead_of_loading_prefillers() -> None:
    wl = trickle(128)
    s, conv = run(wl, True)
    _, plain = run(wl, False)
    assert prefill_ups(plain) >= 20, prefill_ups(plain)  # without: a prefiller loaded for most requests
    assert prefill_ups(conv) <= 2 and conv.converted_prefills >= 35, (prefill_ups(conv), conv.converted_prefills)
    assert conv.gpu_seconds < 0.85 * plain.gpu_seconds, (conv.gpu_seconds, plain.gpu_seconds)
    assert sum(conv.ttft_s) < sum(plain.ttft_s)  # no load to wait for
    # A converted prefill stalls the decoder's running requests for at most one short prefill per
    # token: no request's mean time between tokens exceeds a decode step plus that prefill.
    bound = SPEC.cost.decode_s(SPEC.max_batch, SPEC.max_batch * 4096) + SPEC.cost.prefill_s(system("kascade").convert_max_tokens)
    assert max(conv.tbt_s) <= bound, (max(conv.tbt_s), bound)
    assert conv.kv_peak_fraction <= 1.0 and conv.requests == len(wl.requests)
    assert all(s.served_by[k].startswith("i") for k in range(len(wl.requests)))


def test_long_prompts_are_not_converted() -> None:
    # Prompts above `convert_max_tokens` would stall the decoder's running requests for a long
    # prefill: they wait for a prefiller, as without the feature.
    wl = trickle(4096)
    _, conv = run(wl, True)
    _, plain = run(wl, False)
    assert conv.converted_prefills == 0
    assert prefill_ups(conv) >= 20 and conv.ttft_s == plain.ttft_s
