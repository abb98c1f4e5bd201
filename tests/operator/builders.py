"""Builders for operator tests: ModelService specs and pod views from short descriptions."""

from __future__ import annotations

from typing import Any

from kascade_operator.api import ModelServiceSpec
from kascade_operator.pool import PodView


def spec(mode: str = "colocated", lo: int = 1, hi: int = 4, desired: int | None = None) -> ModelServiceSpec:
    replicas: dict[str, Any] = ({"colocated": {"min": lo, "max": hi}} if mode == "colocated"
                                else {"prefill": {"min": lo, "max": hi}, "decode": {"min": lo, "max": hi}})
    if desired is not None:
        replicas["desired"] = desired
    return ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"path": "/models/m"}},
                                            "engine": {"image": "kascade/engine:dev"}, "mode": mode,
                                            "replicas": replicas})


def pod(name: str, node: str = "n0", ms: str | None = None, role: str | None = None, ready: bool = False,
        leaf: str | None = None, draining: bool = False, drained: bool = False, pool: bool = True) -> PodView:
    return PodView(name, node, "1", pool, ms, role, ready, draining, drained, f"127.0.0.1:{9000 + len(name)}",
                   None, name, None, leaf)
