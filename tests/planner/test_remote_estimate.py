"""The remote path's expected time for a prompt a converted decoder would send a prefill engine now
(`kascade_planner.conversion.remote_prefill_s`): the oldest wait of the prompts queued there plus their tokens and the
new prompt's at the prefill engine's measured pace, never under the recent average. Pure; the engine
(tests/engine/test_remote_queue.py) and the simulator (tests/sim/test_convertible.py) decide by it."""

from __future__ import annotations

import math

import pytest

from kascade_planner.conversion import arrival_verdict, remote_prefill_s


def test_without_a_pace_it_is_the_average_or_the_oldest_wait() -> None:
    assert remote_prefill_s(None, []) is None
    assert remote_prefill_s(None, [], 4096) is None  # tokens without a pace are not seconds
    assert remote_prefill_s(0.3, []) == 0.3
    assert remote_prefill_s(0.3, [1.5, 0.2], 4096) == 1.5
    assert remote_prefill_s(None, [0.2]) == 0.2


def test_a_prompt_sent_now_waits_for_the_queue_ahead_of_it() -> None:
    # bench/pd.py's burst: the average 0.3 s, the oldest queued prompt waited 0.3 s, 8 prompts of
    # 4096 tokens ahead at a prefiller's ~9750 tok/s. The old estimate said 0.3 s; a prompt sent now waits ~3.4 s
    # for the queue, then ~0.42 s for itself.
    pace = 9750.0
    est = remote_prefill_s(0.3, [0.3], 8 * 4096 + 4096, pace)
    assert est == pytest.approx(0.3 + 9 * 4096 / pace)
    # and a converted decoder prefilling at 6430 tok/s (0.64 s for 4096 tokens) beside its decodes keeps it, where
    # the old estimate (0.3 s) declined it
    assert arrival_verdict(4096, 6430.0, est, 11) is None
    assert arrival_verdict(4096, 6430.0, remote_prefill_s(0.3, [0.3]), 11) is not None


def test_the_average_is_a_floor_not_an_addend() -> None:
    # nothing in flight: a short prompt takes what recent ones took (link and all), not that plus its own compute
    assert remote_prefill_s(0.5, [], 100, 1000.0) == 0.5
    # a long one takes at least its own tokens at the pace, however short the recent ones were
    assert remote_prefill_s(0.5, [], 10_000, 1000.0) == pytest.approx(10.0)
    # measured pace, nothing landed yet: the queue alone
    assert remote_prefill_s(None, [], 2000, 1000.0) == pytest.approx(2.0)
    assert remote_prefill_s(None, [0.25], 2000, 1000.0) == pytest.approx(2.25)


def test_bad_input_is_named() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="pace"):
            remote_prefill_s(0.3, [], 10, bad)
    with pytest.raises(ValueError, match="queued_tokens"):
        remote_prefill_s(0.3, [], -1, 10.0)
