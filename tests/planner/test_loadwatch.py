"""The load watch's wire and the windowed rate both ends compute (kascade_planner.loadwatch)."""

from __future__ import annotations

import pytest

from kascade_planner.loadwatch import BAND_MIN_TPS, LoadWatch, WindowRate, band_around


def test_the_query_round_trips_and_a_plain_scrape_is_no_watch() -> None:
    w = LoadWatch(1250.0, 750.0, 1.0, 10.0)
    q = dict(kv.split("=") for kv in w.to_query().split("&"))
    assert LoadWatch.from_query(q) == w
    assert LoadWatch.from_query({}) is None


@pytest.mark.parametrize(("query", "field"), [
    ({"wait": "5", "below": "0", "window": "1"}, "above"),
    ({"wait": "5", "above": "x", "below": "0", "window": "1"}, "above"),
    ({"wait": "5", "above": "1", "below": "2", "window": "1"}, "below"),
    ({"wait": "5", "above": "1", "below": "0", "window": "0"}, "window"),
    ({"wait": "0", "above": "1", "below": "0", "window": "1"}, "wait"),
    ({"wait": "nan", "above": "1", "below": "0", "window": "1"}, "wait"),
])
def test_a_bad_query_names_its_field(query: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        LoadWatch.from_query(query)


def test_the_band_is_a_quarter_either_side_and_never_narrower_than_the_minimum() -> None:
    assert band_around(4000.0, 1.0, 10.0) == LoadWatch(5000.0, 3000.0, 1.0, 10.0)
    idle = band_around(0.0, 1.0, 10.0)
    assert (idle.above, idle.below) == (BAND_MIN_TPS, -BAND_MIN_TPS)
    assert not idle.left(0.0) and not idle.left(None) and idle.left(BAND_MIN_TPS + 1)
    assert band_around(4000.0, 1.0, 10.0).left(2999.0)


def test_the_rate_is_over_the_newest_sample_at_least_the_window_old() -> None:
    r = WindowRate()
    assert r.rate(1.0) is None
    for k in range(5):  # 0..1 s idle, then 5000 tokens/s from t = 1.0
        r.add(k * 0.25, 0.0)
    r.add(1.25, 1250.0)
    assert r.rate(1.0) == pytest.approx(1250.0 / 1.0, rel=1e-6)  # base t = 0.25 (the newest <= 1.25 - 1.0)
    assert r.rate(0.25) == pytest.approx(1250.0 / 0.25, rel=1e-6)  # base t = 1.0
    r.add(1.5, 10.0)  # the counter went down: an engine restart starts over
    assert r.rate(1.0) is None


def test_old_samples_are_dropped_but_one_base_is_kept() -> None:
    r = WindowRate(keep_s=1.0)
    for k in range(50):
        r.add(k * 0.1, k * 10.0)
    assert r.rate(10.0) == pytest.approx(100.0)  # only ~1 s kept: the oldest kept is the base
    assert len(r._s) <= 12
