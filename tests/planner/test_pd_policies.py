"""The P:D ratio policy and the convertible-decoder policy (pure), checked with values."""

from __future__ import annotations

import pytest

from kascade_planner.conversion import (
    DEFAULT_CHUNK,
    MAX_CHUNK,
    MIN_CHUNK,
    STEP_BUDGET_SHARE,
    ConversionInput,
    DecoderView,
    chunk_budget,
    plan_conversions,
)
from kascade_planner.pdratio import PdDemand, PdVelocity, pd_ratio
from kascade_planner.policies import Bounds

V = PdVelocity(prefill_tokens_per_s=1000, network_tokens_per_s=4000, decode_tokens_per_s=100)


def test_ratio_follows_the_velocities_when_nothing_is_capped() -> None:
    r = pd_ratio(PdDemand(2500, 350), V, Bounds(0, 10), Bounds(1, 10))
    assert (r.prefill, r.decode) == (3, 4)  # 2.5 -> 3 prefillers, 3.5 -> 4 decoders
    assert r.prefill_need == pytest.approx(2.5) and r.decode_need == pytest.approx(3.5)
    assert r.served_fraction == 1.0 and r.ratio == pytest.approx(0.75)
    assert "3P:4D" in r.reason


def test_the_slower_of_prefill_and_the_kv_link_sizes_prefill() -> None:
    slow_link = PdVelocity(1000, 500, 100)
    assert pd_ratio(PdDemand(2500, 100), slow_link, Bounds(0, 10), Bounds(1, 10)).prefill == 5


def test_a_capped_prefill_sizes_decode_for_the_share_it_serves() -> None:
    # prefill wants 4 but may have 2: half the demand is served, so decode needs 8 * 0.5 = 4, not 8
    r = pd_ratio(PdDemand(4000, 800), V, Bounds(0, 2), Bounds(1, 16))
    assert (r.prefill, r.decode) == (2, 4)
    assert r.served_fraction == pytest.approx(0.5)
    assert "prefill capped at max 2" in r.reason


def test_a_capped_decode_sizes_prefill_for_the_share_it_serves() -> None:
    # decode wants 10 but may have 5: prefill needs 6 * 0.5 = 3
    r = pd_ratio(PdDemand(6000, 1000), V, Bounds(0, 16), Bounds(1, 5))
    assert (r.prefill, r.decode) == (3, 5)
    assert "decode capped at max 5" in r.reason


def test_no_demand_keeps_one_decoder_and_the_prefill_minimum() -> None:
    assert (lambda r: (r.prefill, r.decode))(pd_ratio(PdDemand(0, 0), V, Bounds(0, 4), Bounds(0, 4))) == (0, 1)
    assert (lambda r: (r.prefill, r.decode))(pd_ratio(PdDemand(0, 0), V, Bounds(2, 4), Bounds(3, 4))) == (2, 3)


def test_headroom_and_bad_values() -> None:
    r = pd_ratio(PdDemand(1000, 100), PdVelocity(1000, 1000, 100, headroom=1.5), Bounds(0, 9), Bounds(1, 9))
    assert (r.prefill, r.decode) == (2, 2)
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        PdVelocity(1, 1, 0)
    with pytest.raises(ValueError, match="input="):
        PdDemand(-1, 0)


def decoders(
    *names: str, converted: tuple[str, ...] = (), load: dict[str, int] | None = None
) -> tuple[DecoderView, ...]:
    return tuple(DecoderView(n, n in converted, (load or {}).get(n, 0)) for n in names)


def test_a_burst_converts_the_least_loaded_decoders_to_cover_the_deficit() -> None:
    # 1 prefiller at 100 tok/s, 220 arriving: deficit 120, a converted decoder adds 50 -> 3 converted
    c = plan_conversions(
        ConversionInput(220, 1, 100.0, decoders("d0", "d1", "d2", "d3", load={"d0": 5, "d2": 1}), tbt_slo_s=0.2)
    )
    assert c.convert == ("d1", "d3", "d2") and c.revert == () and c.converted == 3
    assert c.chunk_tokens == 10  # 0.5 * 0.2 s * 100 tok/s
    assert "deficit 120 tok/s" in c.reason


def test_conversions_only_grow_while_the_deficit_lasts_and_are_capped_by_the_decoders() -> None:
    held = plan_conversions(ConversionInput(130, 1, 100.0, decoders("d0", "d1", converted=("d0", "d1"))))
    assert not held.changes and held.converted == 2  # deficit 30 needs 1, but none is taken back mid-burst
    more = plan_conversions(ConversionInput(10_000, 0, 100.0, decoders("d0", "d1", converted=("d0",))))
    assert more.convert == ("d1",) and more.converted == 2


def test_new_prefill_capacity_takes_every_conversion_back() -> None:
    c = plan_conversions(
        ConversionInput(180, 2, 100.0, decoders("d0", "d1", "d2", converted=("d2", "d0")), prefill_queue=0)
    )
    assert c.revert == ("d0", "d2") and c.convert == () and c.converted == 0
    assert "take back d0, d2" in c.reason


def test_waiting_prompts_keep_the_conversion() -> None:
    c = plan_conversions(ConversionInput(0, 1, 100.0, decoders("d0", converted=("d0",)), prefill_queue=3))
    assert not c.changes and c.converted == 1


def test_no_velocity_holds_and_no_deficit_does_nothing() -> None:
    assert not plan_conversions(ConversionInput(1e6, 0, None, decoders("d0"))).changes
    quiet = plan_conversions(ConversionInput(50, 1, 100.0, decoders("d0")))
    assert not quiet.changes and quiet.reason.endswith("no deficit")


def test_chunk_budget_from_the_tbt_objective() -> None:
    assert chunk_budget(0.1, 2000) == 100
    assert chunk_budget(None, 2000) == DEFAULT_CHUNK and chunk_budget(0.1, None) == DEFAULT_CHUNK
    assert chunk_budget(0.001, 10) == MIN_CHUNK and chunk_budget(10, 1e6) == MAX_CHUNK
    with pytest.raises(ValueError, match="tbt_slo_s"):
        ConversionInput(1, 1, 1.0, (), tbt_slo_s=0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        ConversionInput(1, 1, 0.0, ())


def test_the_chunk_budget_leaves_the_decode_step_its_time() -> None:
    """A mixed step takes the decodes' time plus the chunk's: the chunk gets half the objective at most, and
    no more than what the measured decode step leaves of it."""
    assert chunk_budget(0.1, 2000, decode_step_s=0.02) == 100  # a fast decode step: half the objective
    assert chunk_budget(0.1, 2000, decode_step_s=0.08) == 40  # 20 ms left of 100 ms at 2000 tok/s
    assert chunk_budget(0.036, 2250, decode_step_s=0.030) == 13  # the CPU bench: 6 ms left (half would be 40)
    assert chunk_budget(0.1, 2000, decode_step_s=0.15) == MIN_CHUNK  # decodes alone miss it: the smallest chunk
    c = plan_conversions(ConversionInput(220, 1, 100.0, decoders("d0"), tbt_slo_s=0.2, decode_step_s=0.16))
    assert c.chunk_tokens == MIN_CHUNK and c.convert == ("d0",) and "decode step 160.0 ms" in c.reason
    with pytest.raises(ValueError, match="decode_step_s"):
        ConversionInput(1, 1, 1.0, (), decode_step_s=-0.1)


def test_a_converted_decoder_gets_a_step_time_budget_from_the_tbt_objective() -> None:
    """Beside the token cap, the engine is told the time a step that decodes may take with its chunk (it cuts
    chunks to it with its own measured step cost): a share of the TBT objective, none without one."""
    c = plan_conversions(ConversionInput(220, 1, 100.0, decoders("d0"), tbt_slo_s=0.05))
    assert c.convert == ("d0",) and c.step_budget_s == pytest.approx(STEP_BUDGET_SHARE * 0.05)
    back = plan_conversions(ConversionInput(10, 1, 100.0, (DecoderView("d0", True),), tbt_slo_s=0.05))
    assert back.revert == ("d0",) and back.step_budget_s == pytest.approx(STEP_BUDGET_SHARE * 0.05)
    assert plan_conversions(ConversionInput(220, 1, 100.0, decoders("d0"))).step_budget_s is None


def test_a_converted_decoder_counts_as_its_measured_share_of_a_prefiller() -> None:
    """The decoders' measured share replaces CONVERTED_SHARE: at 0.1 of a prefiller, a deficit of 120 tok/s
    (1 prefiller at 100, 220 arriving) needs 12 decoders, not 3 (capped by the 5 there are); unmeasured, 3."""
    names = ("d0", "d1", "d2", "d3", "d4")
    slow = plan_conversions(ConversionInput(220, 1, 100.0, decoders(*names), converted_share=0.1))
    assert slow.converted == 5 and "0.10 of a prefiller" in slow.reason
    assert plan_conversions(ConversionInput(220, 1, 100.0, decoders(*names), converted_share=0.4)).converted == 3
    unmeasured = plan_conversions(ConversionInput(220, 1, 100.0, decoders(*names)))
    assert unmeasured.converted == 3 and "(not measured)" in unmeasured.reason
    with pytest.raises(ValueError, match="converted_share"):
        ConversionInput(1, 1, 1.0, (), converted_share=0.0)
    with pytest.raises(ValueError, match="converted_share"):
        ConversionInput(1, 1, 1.0, (), converted_share=1.5)


def test_the_converted_share_is_the_decoder_rate_over_the_prefill_rate() -> None:
    """Rate over rate within [MIN_SHARE, 1]; the constant until both are measured; a decoder rate of 0 is a
    measurement (its budgets gave prompts nothing), not a gap; bad input names the argument."""
    from kascade_planner.conversion import CONVERTED_SHARE, MIN_SHARE, converted_share

    assert converted_share(90.0, 900.0) == pytest.approx(0.1)
    assert converted_share(2000.0, 900.0) == 1.0
    assert converted_share(0.0, 900.0) == MIN_SHARE
    assert converted_share(None, 900.0) == converted_share(90.0, None) == converted_share(90.0, 0.0) == CONVERTED_SHARE
    with pytest.raises(ValueError, match="decoder_rate"):
        converted_share(-1.0, 900.0)
    with pytest.raises(ValueError, match="prefill_rate"):
        converted_share(1.0, float("nan"))


def test_a_prompt_a_new_prefiller_finishes_first_is_declined() -> None:
    """Issue 39: decoders chunk-prefilled 12k-token prompts that a new prefiller, its load included, would have
    finished sooner (long-prompt TTFT 7.5 s -> 13.6 s). 12,000 tokens at 3,000 tok/s beside decodes take 4 s here."""
    from kascade_planner.conversion import arrival_verdict, new_prefill_s

    fresh = new_prefill_s(0.7, 12_000, 20_000.0)  # a live load's first layer + the prompt at a prefiller's velocity
    assert fresh == pytest.approx(1.3)
    why = arrival_verdict(12_000, 3_000.0, None, decodes=8, new_prefiller_s=fresh)
    assert why is not None and "a new one" in why and "4.000 s here" in why
    assert arrival_verdict(12_000, 3_000.0, None, decodes=8, new_prefiller_s=5.0) is None  # no new one beats it
    assert arrival_verdict(12_000, 3_000.0, None, decodes=0, new_prefiller_s=fresh) is None  # idle: full speed
    assert arrival_verdict(12_000, 3_000.0, None, decodes=8) is None  # no prefiller can come: it takes it
    with pytest.raises(ValueError, match="new_prefiller_s"):
        arrival_verdict(12_000, 3_000.0, None, decodes=8, new_prefiller_s=-1.0)


def test_the_queue_bound_counts_prompt_tokens_against_capacity() -> None:
    """queueLength with `queue_drain_s`: 3 waiting 12k-token prompts are 3.6 s of prefill for one 10k tok/s
    instance, over a 1 s bound -> 4 instances; by count alone (3 < 4 per instance) nothing would scale."""
    from kascade_planner.policies import (
        Bounds,
        MeasuredVelocity,
        MetricsSnapshot,
        ScaleState,
        Threshold,
        threshold,
    )

    st = ScaleState("prefill", 1, Bounds(0, 8))
    cap = MeasuredVelocity(prefill_capacity_tokens_per_s=10_000.0)
    snap = MetricsSnapshot(10.0, in_flight=3, queue_tokens=36_000.0, measured=cap)
    by_count = threshold(snap, st, Threshold(4.0, 0.3, 0.5, "queueLength"))
    assert by_count.change == 0
    d = threshold(snap, st, Threshold(4.0, 0.3, 0.5, "queueLength", queue_drain_s=1.0))
    assert d.desired == 4 and "3.60 s at 10000 tok/s" in d.reason and ("queueDrainSeconds", 3.6) in d.metrics
    short = MetricsSnapshot(10.0, in_flight=3, queue_tokens=3_000.0, measured=cap)  # 0.3 s: within the bound
    assert threshold(short, st, Threshold(4.0, 0.3, 0.5, "queueLength", queue_drain_s=1.0)).change == 0
    unmeasured = MetricsSnapshot(10.0, in_flight=3, queue_tokens=36_000.0)  # no capacity: by count
    assert threshold(unmeasured, st, Threshold(4.0, 0.3, 0.5, "queueLength", queue_drain_s=1.0)).change == 0
    with pytest.raises(ValueError, match="queue_drain_s"):
        Threshold(4.0, 0.3, 0.5, "queueLength", queue_drain_s=0.0)
