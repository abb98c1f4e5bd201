"""Every CRD field is described (so `kubectl explain` teaches the API) and docs/api-reference.md is the
current rendering of the CRDs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_api_reference", REPO / "hack" / "gen_api_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_field_has_a_description_and_the_reference_is_current() -> None:
    gen = _gen()
    text, missing = gen.render()
    assert missing == []
    assert (REPO / "docs" / "api-reference.md").read_text() == text, "run python hack/gen_api_reference.py"
    for field in ("spec.scaling.threshold.metric", "spec.replicas.prefill.desired", "spec.slo.ttftMs",
                  "status.conditions[].observedGeneration", "spec.scalePlanHistoryLimit"):
        assert f"`{field}`" in text


def test_a_field_without_description_is_reported() -> None:
    gen = _gen()
    rows: list[list[str]] = []
    missing: list[str] = []
    gen.walk({"type": "object", "properties": {"spec": {"type": "object", "description": "d",
                                                        "properties": {"x": {"type": "integer"}}}}},
             "", False, rows, [], missing)
    assert missing == ["spec.x"]
