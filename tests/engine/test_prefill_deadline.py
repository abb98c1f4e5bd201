"""PrefillDeadline: the wait for a prefill engine follows what is measured of it, within a floor and a cap."""

from __future__ import annotations

import pytest

from kascade_engine.pd.deadline import PrefillDeadline


def test_the_deadline_scales_the_estimate_within_floor_and_cap() -> None:
    d = PrefillDeadline(factor=4.0, floor_s=5.0, cap_s=120.0, default_s=30.0)
    assert d.seconds(None) == 30.0  # nothing measured of the peer
    assert d.seconds(0.1) == 5.0  # a tiny prompt on an idle peer: the floor
    assert d.seconds(10.0) == 40.0  # a queue of 10 s there: four times it
    assert d.seconds(1000.0) == 120.0  # past the cap a local prefill is sooner


@pytest.mark.parametrize(("field", "value"), [("factor", 0.0), ("floor_s", -1.0), ("cap_s", float("inf")),
                                              ("default_s", float("nan")), ("suspect_for_s", 0.0)])
def test_a_bad_setting_is_refused_naming_it(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"PrefillDeadline.{field}"):
        PrefillDeadline(**{field: value})


def test_a_floor_above_the_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="floor_s"):
        PrefillDeadline(floor_s=10.0, cap_s=5.0)
