"""Engine capacity (spec.engine.capacity): fixed at pod start, so the operator honours it by choosing pool
pods started with it and by starting fallback pods with it (issue 32: it could not be set at all)."""

from __future__ import annotations

from typing import Any

from kascade_operator import capacity as C
from kascade_operator import labels as L
from kascade_operator.api import EngineCapacity, ModelServiceSpec
from kascade_operator.podtemplate import fallback_pod
from kascade_operator.pool import can_serve, pod_view

POOL = "kvTokens=65536,maxBatchTokens=512,maxPromptTokens=2048,maxSeqs=64"


def spec(cap: dict[str, int] | None = None, **engine: Any) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"path": "/models/m"}},
                                            "engine": {"image": "img:1", **({"capacity": cap} if cap else {}),
                                                       **engine},
                                            "replicas": {"colocated": {"min": 0, "max": 2}}})


def pool_pod(annotation: str | None) -> Any:
    ann = {L.MODEL: "m", **({L.ENGINE_CAPACITY: annotation} if annotation else {})}
    return pod_view({"metadata": {"name": "p", "labels": {L.POOL: L.POOL_WARM}, "annotations": ann}})


def test_bind_only_pool_pods_started_with_the_asked_capacity() -> None:
    assert can_serve(pool_pod(POOL), "m", "svc", None)
    assert can_serve(pool_pod(POOL), "m", "svc", EngineCapacity(max_prompt_tokens=2048))
    assert not can_serve(pool_pod(POOL), "m", "svc", EngineCapacity(max_prompt_tokens=8192))
    assert not can_serve(pool_pod(POOL), "m", "svc", EngineCapacity(kv_tokens=65536, max_seqs=128))
    assert not can_serve(pool_pod(None), "m", "svc", EngineCapacity(kv_tokens=65536))  # an older chart's pod
    assert can_serve(pool_pod(None), "m", "svc", None)
    assert not can_serve(pool_pod("kvTokens=lots"), "m", "svc", EngineCapacity(kv_tokens=1))


def test_fallback_pod_gets_the_service_capacity_over_the_installation() -> None:
    pool = {"kvTokens": 65536, "maxPromptTokens": 2048, "maxSeqs": 64, "maxBatchTokens": 512}
    pod = fallback_pod(spec({"maxPromptTokens": 8192, "kvTokens": 131072}), "svc", "tok", None,
                       installation_capacity=pool, dtype="bfloat16")
    args = pod["spec"]["containers"][0]["args"]
    assert [a for a in args if a.split("=")[0] in C.FLAGS.values() or a.startswith("--dtype")] == [
        "--kv-tokens=131072", "--max-batch-tokens=512", "--max-prompt-tokens=8192", "--max-seqs=64", "--dtype=bfloat16"]
    ann = pod["metadata"]["annotations"][L.ENGINE_CAPACITY]
    assert ann == "kvTokens=131072,maxBatchTokens=512,maxPromptTokens=8192,maxSeqs=64"
    # the pod it creates is one its own service may bind (and a capacity-free service too)
    view = pod_view(
        {"metadata": {"name": "f", "labels": {L.POOL: L.POOL_WARM}, "annotations": pod["metadata"]["annotations"]}}
    )
    assert can_serve(view, "m", "svc", EngineCapacity(max_prompt_tokens=8192, kv_tokens=131072))


def test_fallback_pod_defaults_resources_from_the_pool() -> None:
    res = {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "48Gi", "nvidia.com/gpu": 1}}
    pod = fallback_pod(spec(), "svc", "tok", None, default_resources=res)
    assert pod["spec"]["containers"][0]["resources"] == res
    own = fallback_pod(spec(resources={"limits": {"nvidia.com/gpu": 2}}), "svc", "tok", None, default_resources=res)
    assert own["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    hub = fallback_pod(ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"uri": "hf://o/m"}},
                                                        "engine": {"image": "img:1"},
                                                        "replicas": {"colocated": {"min": 0, "max": 1}}}),
                       "svc", "tok", None)
    assert hub["spec"]["initContainers"][0]["resources"]["limits"]["memory"]  # the download is bounded too
