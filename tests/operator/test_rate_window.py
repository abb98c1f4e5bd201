"""Windowed rates: a burst of tokens spread over the window instead of spiking one scrape interval."""

from __future__ import annotations

import pytest

from kascade_operator.metrics import InstanceSample, RateTracker


def feed(r: RateTracker, points: list[tuple[float, float]]) -> list[float]:
    return [r.update("a", InstanceSample(t, input_tokens=v)).input_tokens_per_s for t, v in points]


def test_window_smooths_a_spike_that_the_last_two_scrapes_exaggerate() -> None:
    # 16 prompt tokens admitted at t=1.0, nothing else; scrapes every 0.25 s
    pts = [
        (0.0, 0),
        (0.25, 0),
        (0.5, 0),
        (0.75, 0),
        (1.0, 16),
        (1.25, 16),
        (1.5, 16),
        (1.75, 16),
        (2.0, 16),
        (2.25, 16),
    ]
    fast = feed(RateTracker(0.0), pts)
    slow = feed(RateTracker(1.0), pts)
    assert fast[4] == 64.0 and fast[5] == 0.0  # one interval sees 64 tok/s, the next 0
    assert slow[4] == 16.0 and slow[5] == 16.0 and slow[7] == 16.0  # the same 16 tokens over one second
    assert slow[-1] == 0.0  # the admission has left the window


def test_window_keeps_a_steady_rate_exact_and_survives_a_reset() -> None:
    r = RateTracker(1.0)
    rates = feed(r, [(t / 4, 100 * t / 4) for t in range(12)])  # 100 tok/s steadily
    assert rates[0] == 0.0 and all(x == pytest.approx(100.0) for x in rates[1:])
    reset = r.update("a", InstanceSample(3.0, input_tokens=10))  # the engine restarted
    assert reset.input_tokens_per_s == pytest.approx(40.0)  # counted from zero since the last sample
    assert r.update("a", InstanceSample(3.25, input_tokens=35)).input_tokens_per_s == pytest.approx(100.0)
    with pytest.raises(ValueError, match="window_s"):
        RateTracker(-1)


def test_the_decode_step_time_is_the_windows_mean_of_decode_only_steps() -> None:
    """kascade_step_seconds{kind="decode"} -> the snapshot's decode_step_s (the converted decoder's room in
    the chunk budget); mixed and prefill steps are not decode steps; no decode step in the window: None."""
    from kascade_operator.metrics import parse_engine_metrics, snapshot

    def text(dec_sum: float, dec_n: int) -> str:
        return ("# TYPE kascade_step_seconds histogram\n"
                f'kascade_step_seconds_sum{{model_name="m",kind="decode"}} {dec_sum}\n'
                f'kascade_step_seconds_count{{model_name="m",kind="decode"}} {dec_n}\n'
                'kascade_step_seconds_sum{model_name="m",kind="mixed"} 9.0\n'
                'kascade_step_seconds_count{model_name="m",kind="mixed"} 3\n')

    r = RateTracker(1.0)
    r.update("a", parse_engine_metrics(text(1.0, 50), 0.0))
    load = r.update("a", parse_engine_metrics(text(1.6, 70), 1.0))  # 20 steps took 0.6 s in the window
    assert (load.decode_step_sum, load.decode_step_count) == pytest.approx((0.6, 20))
    assert snapshot([load], 1.0).decode_step_s == pytest.approx(0.03)
    still = r.update("a", parse_engine_metrics(text(1.6, 70), 2.1))
    assert snapshot([still], 2.1).decode_step_s is None


def test_the_base_is_exactly_one_window_ago_between_sparse_samples() -> None:
    """Sweeps 1 s apart while idle, then a burst seen between them (a load watch's answer): the 1 s rate is over
    1 s (the counters one window ago interpolated), not over the 1.5 s back to the older sweep."""
    r = RateTracker(1.0)
    feed(r, [(0.0, 0), (1.0, 0)])
    (rate,) = feed(r, [(1.5, 1000)])  # 5000 tok/s since t = 1.3: 1000 tokens in the last second
    assert rate == pytest.approx(1000.0)  # the older rule: 1000 / 1.5 = 667, under an upper bound of 1000
    (rate,) = feed(r, [(2.25, 1000 + 5000 * 0.75)])  # base at 1.25, between the samples 1.0 and 1.5
    assert rate == pytest.approx((4750 - 1000 * 0.25 / 0.5) / 1.0)
