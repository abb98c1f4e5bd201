"""Spec checks the CRD schema cannot express (they need the cluster or cross-field knowledge).

Data flow: a schema-valid `ModelServiceSpec` + live Node dicts -> a list of "field: problem" strings;
the handler turns a non-empty list into a Degraded condition and an InvalidSpec Event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kascade_operator.api import ModelServiceSpec


def max_gpus(nodes: Sequence[Mapping[str, Any]], gpu_resource: str = "nvidia.com/gpu") -> int:
    """The most allocatable GPUs on any node (0 when no node has any)."""
    return max((int(str(((n.get("status") or {}).get("allocatable") or {}).get(gpu_resource, 0) or 0)) for n in nodes),
               default=0)


def semantic_errors(spec: ModelServiceSpec, most_gpus: int, gpu_resource: str = "nvidia.com/gpu") -> list[str]:
    """`most_gpus`: `max_gpus(nodes)` (0: unknown, not checked)."""
    errs: list[str] = []
    sc = spec.scaling
    if sc is not None and sc.policy == "concurrency" and sc.concurrency is None:
        errs.append("spec.scaling.concurrency: required when spec.scaling.policy is concurrency")
    if most_gpus and spec.engine.tp > most_gpus:
        errs.append(f"spec.engine.tp: {spec.engine.tp} exceeds the most GPUs on any node ({most_gpus}); one "
                    f"instance must fit on one node")
    limits = (spec.engine.resources.limits or {}) if spec.engine.resources else {}
    want = limits.get(gpu_resource)
    if want is not None and str(want) != str(spec.engine.tp):
        errs.append(f"spec.engine.resources.limits.{gpu_resource}: {want} must equal spec.engine.tp ({spec.engine.tp})")
    return errs
