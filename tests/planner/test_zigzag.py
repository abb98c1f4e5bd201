"""ZigZag live execution: the paper's Figure 15 setting, ILP vs ILP-free, schedule sanity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kascade_planner.zigzag import (
    PairSetting,
    best_effort,
    config_cost,
    ilp_config,
    ilp_free,
    run_config,
    stop_the_world,
    zigzag_ilp,
)

FIG15 = PairSetting(layers=7, load_ratio=6, batches=5)


def test_figure15_zigzag_finishes_clearly_before_best_effort() -> None:
    stop, be, free, ilp = (f(FIG15) for f in (stop_the_world, best_effort, ilp_free, zigzag_ilp))
    assert stop.last == 35  # 5 batches x 7 layers, all on the source
    assert ilp.last <= 0.9 * be.last and free.last <= 0.9 * be.last
    assert be.last < stop.last
    # ZigZag really uses the target: later batches run a growing prefix there.
    assert ilp.target_layers[0] == 0 and sum(ilp.target_layers) > 0
    assert list(ilp.target_layers) == sorted(ilp.target_layers)


def test_ilp_free_close_to_ilp_on_many_settings() -> None:
    for layers, ratio, batches in [(32, 6, 12), (16, 4, 8), (7, 6, 5), (24, 10, 6)]:
        s = PairSetting(layers, ratio, batches)
        assert ilp_free(s).average <= 1.10 * zigzag_ilp(s).average, s


def test_no_loading_time_means_even_split() -> None:
    s = PairSetting(layers=8, load_ratio=0, batches=4)
    # With the target fully usable at once, two executors finish 4 batches of 8 layers in ~16.
    assert ilp_free(s).last <= 17


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.floats(0, 12), st.integers(1, 8))
def test_schedules_respect_loading_and_order(layers: int, ratio: float, batches: int) -> None:
    s = PairSetting(layers, ratio, batches)
    stop = stop_the_world(s)
    for sched in (best_effort(s), ilp_free(s), zigzag_ilp(s)):
        assert len(sched.finish) == batches
        # A batch takes at least L layer-times, and nobody beats two executors working in parallel.
        assert min(sched.finish) >= layers - 1e-9
        assert sched.last >= layers * batches / 2 - 1e-9
        # Live modes never lose to stop-the-world by more than the handoff granularity.
        assert sched.last <= stop.last + layers
        for b, t_layers in enumerate(sched.target_layers):
            if t_layers:  # a prefix on T cannot finish before its last layer was loaded
                assert sched.finish[b] >= s.loaded_at(t_layers - 1) + 1 - 1e-9


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="invalid PairSetting"):
        PairSetting(0, 1, 1)
    with pytest.raises(ValueError, match="prefix must give"):
        run_config(FIG15, (0, 1))
    assert len(ilp_config(FIG15)) == 5


def test_ilp_config_is_within_its_gap_of_the_exact_ilp() -> None:
    for layers, ratio, batches in [(32, 6, 12), (16, 4, 8), (32, 3, 12), (7, 6, 5)]:
        s = PairSetting(layers, ratio, batches)
        exact = ilp_config(s, gap=0.0)
        fast = ilp_config(s)
        assert config_cost(s, exact) <= config_cost(s, fast) <= 1.01 * config_cost(s, exact) + 1e-9, s
        # Nothing on T is the source serving alone: Σ_i i·L, which the optimum beats.
        assert config_cost(s, (0,) * batches) == sum(range(layers, layers * batches + 1, layers))
        assert config_cost(s, exact) < config_cost(s, (0,) * batches)
        assert len(fast) == batches and all(0 <= t <= layers for t in fast)
    with pytest.raises(ValueError, match="gap must be >= 0"):
        ilp_config(FIG15, gap=-0.1)


def test_a_plan_made_mid_load_counts_the_landed_layers() -> None:
    """`elapsed` (an engine re-planning from its queue mid-load): landed layers are runnable at once, the
    rest land load_ratio apart from where the load is; the ILP's F_i >= load·T_i - elapsed and its cost
    agree with the simulator's clock; a negative elapsed is refused."""
    s = PairSetting(layers=6, load_ratio=4.0, batches=3, elapsed=10.0)
    assert [s.loaded_at(layer) for layer in range(4)] == [0.0, 0.0, 2.0, 6.0]
    one = PairSetting(layers=6, load_ratio=4.0, batches=1, elapsed=8.0)  # 2 layers here, nothing queued
    assert ilp_free(one).target_layers == (2,)  # runs what is here, the source takes the rest
    assert config_cost(PairSetting(6, 4.0, 1, elapsed=8.0), (2,)) == 6.0  # prefix of 2 done at 2, no wait
    assert config_cost(PairSetting(6, 4.0, 1), (2,)) == 12.0  # from load start: layer 1 lands at 8
    assert ilp_config(PairSetting(6, 4.0, 3, elapsed=24.0)) == ilp_config(PairSetting(6, 0.0, 3))
    with pytest.raises(ValueError):
        PairSetting(6, 4.0, 1, elapsed=-1.0)
