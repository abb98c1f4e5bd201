"""The shared pool (kascade_planner.fleet): node classes, fit, and target choice across models."""

from __future__ import annotations

import re

import pytest

from kascade_planner.fleet import EmptyEngine, ModelNeed, NodeClass, Want, choose_fleet_targets, fits

CLASSES = {"a100": NodeClass("a100", "A100", 80.0), "l4": NodeClass("l4", "L4", 24.0),
           "h100x2": NodeClass("h100x2", "H100", 80.0, 2)}
NEEDS = {"small": ModelNeed("small", 18.0), "mid": ModelNeed("mid", 60.0), "big": ModelNeed("big", 150.0, 2),
         "h100only": ModelNeed("h100only", 20.0, gpu_types=("H100",))}


def test_fit_names_what_is_missing() -> None:
    assert fits(CLASSES["a100"], NEEDS["mid"]) is None
    assert "needs 60" in (fits(CLASSES["l4"], NEEDS["mid"]) or "")
    assert "needs 2" in (fits(CLASSES["a100"], NEEDS["big"]) or "")
    assert "GPU type A100" in (fits(CLASSES["a100"], NEEDS["h100only"]) or "")


def test_best_fit_leaves_the_large_engines_to_the_model_that_needs_them() -> None:
    pool = [EmptyEngine("e-a100", "n1", "a100"), EmptyEngine("e-l4", "n2", "l4")]
    # small comes first in the ranking but takes the L4, so mid still gets the A100
    out = choose_fleet_targets(pool, CLASSES, NEEDS, [Want("small", 1), Want("mid", 1)])
    assert out.of("small") == ("e-l4",) and out.of("mid") == ("e-a100",) and out.unmet == ()


def test_a_node_with_the_models_host_copy_first_and_other_models_copies_last() -> None:
    pool = [EmptyEngine("e1", "n1", "a100", host_copy="mid"), EmptyEngine("e2", "n2", "a100"),
            EmptyEngine("e3", "n3", "a100", host_copy="small")]
    out = choose_fleet_targets(pool, CLASSES, NEEDS, [Want("small", 1), Want("mid", 2)])
    assert out.of("small") == ("e3",)
    assert out.of("mid") == ("e1", "e2")
    out = choose_fleet_targets(pool, CLASSES, NEEDS, [Want("mid", 1)])
    assert out.of("mid") == ("e1",)
    out = choose_fleet_targets(pool[1:], CLASSES, NEEDS, [Want("mid", 1)])
    assert out.of("mid") == ("e2",)  # not the node keeping small's copy while another is free


def test_source_leaf_breaks_ties_then_id() -> None:
    pool = [EmptyEngine("e1", "n1", "a100", leaf="x"), EmptyEngine("e2", "n2", "a100", leaf="y"),
            EmptyEngine("e0", "n0", "a100", leaf="x")]
    out = choose_fleet_targets(pool, CLASSES, NEEDS, [Want("mid", 2, source_leaves=("y",))])
    assert out.of("mid") == ("e2", "e0")


def test_unmet_says_why() -> None:
    pool = [EmptyEngine("e1", "n1", "l4"), EmptyEngine("e2", "n2", "h100x2")]
    out = choose_fleet_targets(pool, CLASSES, NEEDS, [Want("big", 2), Want("mid", 1)])
    assert out.of("big") == ("e2",)
    assert out.unmet[0][:2] == ("big", 1) and "l4: 1 GPU(s) per engine" in out.unmet[0][2]
    assert out.unmet[1][:2] == ("mid", 1) and "needs 60" in out.unmet[1][2]


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match=re.escape("node class x: gpu_memory_gib must be a finite number > 0, got 0")):
        NodeClass("x", "A100", 0.0)
    with pytest.raises(ValueError, match=re.escape("node class x: gpus_per_engine must be >= 1, got 0")):
        NodeClass("x", "A100", 80.0, 0)
    with pytest.raises(ValueError, match=re.escape("NodeClass.name must be non-empty")):
        NodeClass("", "A100", 80.0)
    with pytest.raises(ValueError, match=re.escape("model m: memory_gib must be a finite number > 0, got -1.0")):
        ModelNeed("m", -1.0)
    with pytest.raises(ValueError, match=re.escape("model m: gpus must be >= 1, got 0")):
        ModelNeed("m", 1.0, 0)
    with pytest.raises(ValueError, match=re.escape("ModelNeed.model must be non-empty")):
        ModelNeed("", 1.0)
    with pytest.raises(ValueError, match="node class 'nope'"):
        choose_fleet_targets([EmptyEngine("e", "n", "nope")], CLASSES, NEEDS, [])
    with pytest.raises(ValueError, match="no ModelNeed"):
        choose_fleet_targets([], CLASSES, NEEDS, [Want("ghost", 1)])
    with pytest.raises(ValueError, match="count"):
        choose_fleet_targets([], CLASSES, NEEDS, [Want("mid", -1)])
