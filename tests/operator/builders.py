"""Builders for operator tests: ModelService specs and pod views from short descriptions."""

from __future__ import annotations

from typing import Any

from kascade_operator.api import ModelServiceSpec
from kascade_operator.pool import PodView


def spec(mode: str = "colocated", lo: int = 1, hi: int = 4, desired: int | None = None, model: Any = "m",
         **extra: Any) -> ModelServiceSpec:
    """`model`: a model name, or the whole spec.model; `extra`: more spec fields (dicts merge one level)."""
    if isinstance(model, dict):
        extra["model"], model = model, model["name"]
    replicas: dict[str, Any] = ({"colocated": {"min": lo, "max": hi}} if mode == "colocated"
                                else {"prefill": {"min": lo, "max": hi}, "decode": {"min": lo, "max": hi}})
    if desired is not None:
        replicas["desired"] = desired
    doc: dict[str, Any] = {"model": {"name": model, "source": {"path": "/models/m"}},
                           "engine": {"image": "kascade/engine:dev"}, "mode": mode, "replicas": replicas}
    for k, v in extra.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
    return ModelServiceSpec.model_validate(doc)


def pod(name: str, node: str | None = "n0", ms: str | None = None, role: str | None = None, ready: bool = False,
        leaf: str | None = None, draining: bool = False, drained: bool = False, pool: bool = True,
        model: str | None = None, created_for: str | None = None, pod_ready: bool = True,
        unschedulable: bool = False, plan: str | None = None) -> PodView:
    return PodView(name, node, "1", pool, ms, role, ready, draining, drained, f"127.0.0.1:{9000 + len(name)}",
                   None, name, plan, leaf, model=model, created_for=created_for, pod_ready=pod_ready,
                   unschedulable=unschedulable)
