"""Engine capacity: the `kascade engine serve` flags that size an engine (KV cache, prompt, batch,
sequences). They are fixed when the pod starts: `bind` loads weights into a started engine and cannot
resize its preallocated KV cache, so a ModelService's spec.engine.capacity is honoured by choosing pods,
not by changing them.

- Pool pods carry annotation `kascade.io/engine-capacity` (the chart's pool.engine values, in the form
  `annotation()` writes). A service that sets capacity binds only pool pods whose annotation has exactly
  its values for every field it sets; a pod without the annotation (started by an older chart) matches
  only services that set none.
- Fallback pods are started with the service's values over the installation's (chart pool.engine,
  setting engine_capacity) and annotated the same way.

Data flow: spec.engine.capacity + settings.engine_capacity -> `effective()` -> `args()` (fallback pod's
flags) and `annotation()`; pool pod annotation -> `parse()` -> `matches()` (pool.can_serve).
"""

from __future__ import annotations

from collections.abc import Mapping

from kascade_operator.api import EngineCapacity

# camelCase key (CRD, annotation, chart) -> engine serve flag
FLAGS = {"kvTokens": "--kv-tokens", "maxBatchTokens": "--max-batch-tokens", "maxPromptTokens": "--max-prompt-tokens",
         "maxSeqs": "--max-seqs"}


def wanted(cap: EngineCapacity | None) -> dict[str, int]:
    """The fields a service set, by camelCase key."""
    return {} if cap is None else {k: int(v) for k, v in cap.model_dump(by_alias=True, exclude_none=True).items()}


def effective(cap: EngineCapacity | None, installation: Mapping[str, int]) -> dict[str, int]:
    """A fallback pod's capacity: the service's values over the installation's."""
    return {**{k: int(v) for k, v in installation.items() if k in FLAGS}, **wanted(cap)}


def args(values: Mapping[str, int]) -> list[str]:
    return [f"{FLAGS[k]}={values[k]}" for k in sorted(values)]


def annotation(values: Mapping[str, int]) -> str:
    """`kvTokens=65536,maxBatchTokens=512,...`, keys sorted (the chart's kascade.engineCapacity writes the same)."""
    return ",".join(f"{k}={values[k]}" for k in sorted(values))


def parse(text: str | None) -> dict[str, int] | None:
    """The annotation back as a dict; None when absent or malformed (then only capacity-free services bind)."""
    if not text:
        return None
    out: dict[str, int] = {}
    for part in text.split(","):
        k, sep, v = part.strip().partition("=")
        if not sep or k not in FLAGS or not v.isdigit():
            return None
        out[k] = int(v)
    return out


def matches(pod_annotation: str | None, cap: EngineCapacity | None) -> bool:
    """May a service asking for `cap` bind a pool pod started with this annotation?"""
    want = wanted(cap)
    if not want:
        return True
    have = parse(pod_annotation)
    return have is not None and all(have.get(k) == v for k, v in want.items())
