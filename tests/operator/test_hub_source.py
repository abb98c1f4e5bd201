"""spec.model.source.uri `hf://`: accepted in the documented form only (an error names the field),
carried through the ScalePlan to the engine's bind as `source.uri`, and a fallback pod for it mounts
nothing of the node: an init container fetches config + tokenizer, the engine downloads the weights
with the installation's HF_ENDPOINT and HF_TOKEN Secret."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from builders import spec
from pydantic import ValidationError

from kascade_operator.api import ModelServiceSpec
from kascade_operator.engine_client import EngineClient
from kascade_operator.handlers import field_errors
from kascade_operator.podtemplate import checkpoint_path, fallback_pod, refusals
from kascade_operator.reconcile import reconcile
from kascade_operator.settings import OperatorSettings
from kascade_operator.sourcehealth import source_blocker
from kascade_operator.status import service_status

HF = {"name": "m", "source": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@v1"}}


@pytest.mark.parametrize("uri", ["hf://SmolLM2", "hf://a/b/c", "s3://bucket/m", "hf://a/b@", "https://hf.co/a/b",
                                 "hf://a/..", "file:/x"])
def test_malformed_uri_is_refused_naming_the_field(uri: str) -> None:
    doc = spec().model_dump(by_alias=True, exclude_none=True)
    doc["model"]["source"] = {"uri": uri}
    with pytest.raises(ValidationError) as e:
        ModelServiceSpec.model_validate(doc)
    assert field_errors(e.value).startswith("spec.model.source.uri: ")


def test_hub_source_goes_to_the_bind_and_needs_no_host_path() -> None:
    s = spec(model=HF)
    assert checkpoint_path(s) == "hf://HuggingFaceTB/SmolLM2-135M-Instruct@v1"
    assert refusals(s, OperatorSettings(engine_token="t", engine_image="kascade/engine:dev")) == []
    pod = fallback_pod(s, "svc", "engine-token", None, hf_endpoint="http://mirror:8080", hf_token_secret="hf-token")
    podspec = pod["spec"]
    assert not any("hostPath" in v for v in podspec["volumes"])
    (init,) = podspec["initContainers"]
    assert init["args"] == ["kascade", "model", "download", "HuggingFaceTB/SmolLM2-135M-Instruct", "--revision=v1",
                            "--dest=/kascade/model", "--config-only"]
    (engine,) = podspec["containers"]
    assert "--checkpoint=/kascade/model" in engine["args"]
    for c in (init, engine):
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_ENDPOINT"]["value"] == "http://mirror:8080"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    plain = fallback_pod(s, "svc", "engine-token", None)["spec"]["containers"][0]["env"]
    assert {e["name"] for e in plain} == {
        "KASCADE_ENGINE_TOKEN",
        "KASCADE_LOG_FORMAT",
        "HOME",
        "HF_HOME",
    }  # no Secret the chart did not name


async def test_engine_client_binds_a_hub_source_as_uri() -> None:
    seen: list[dict[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        return httpx.Response(200, json={"phase": "loading"})

    ec = EngineClient("t", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    await ec.bind("10.0.0.1:8000", "m", "ns/svc", "colocated", "hf://org/m@main")
    await ec.bind("10.0.0.1:8000", "m", "ns/svc", "colocated", "/models/m")
    await ec.aclose()
    assert seen[0]["source"] == {"uri": "hf://org/m@main"} and seen[1]["source"] == {"path": "/models/m"}


def _plan(name: str, phase: str, done: str, source: str, failed: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": done},
        "spec": {"modelServiceRef": {"name": "svc"}, "sources": [{"instance": "t", "kind": "host", "path": source}]},
        "status": {
            "phase": phase,
            "completionTime": done,
            "targets": [{"instance": "t", **({"failed": failed} if failed else {})}],
        },
    }


def test_a_failed_download_stalls_the_service_naming_the_field() -> None:
    uri = "hf://org/m@main"
    why = (f"load error: source.uri (spec.model.source.uri): {uri} from http://hub: the Hub rejected HF_TOKEN "
           "(HTTP 401: Invalid credentials in Authorization header)")
    failed = _plan("svc-a", "Failed", "2026-01-01T00:00:02Z", uri, why)
    b = source_blocker([failed], "svc", uri)
    assert b is not None and b.reason == "SourceUnavailable"
    assert b.message.startswith("spec.model.source.uri: ") and "HTTP 401" in b.message and "svc-a" in b.message
    st = service_status("svc", "svc", reconcile("svc", spec(model=HF), [], []), [], [], 1, b)
    stalled = next(c for c in st["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and "spec.model.source.uri" in stalled["message"]
    # a later success from the same source, another source, or a failure that is not the source's: no blocker
    assert source_blocker([failed, _plan("svc-b", "Succeeded", "2026-01-01T00:00:03Z", uri)], "svc", uri) is None
    assert source_blocker([failed], "svc", "hf://org/other") is None
    assert source_blocker([_plan("svc-c", "Failed", "2026-01-01T00:00:04Z", uri, "pod x was deleted")], "svc",
                          uri) is None
