"""An hf:// ModelService on the real control plane with a REAL engine (an empty `kascade engine serve`
process behind a KWOK pool pod) and a local Hub (HubServer at HF_ENDPOINT, a real tiny checkpoint):
a repository the Hub does not have stalls the service with a condition and an Event naming
spec.model.source.uri; fixing the URI in place brings it to Ready, the first copy downloaded from the
Hub by the engine itself (its bytes and answers are the checkpoint's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.hubserver import HubServer
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for
from kascade_engine.weights.blocks import pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama

pytestmark = pytest.mark.cluster
TOKEN, HF_TOKEN, MODEL = "hub-test-token", "hf_cluster_token", "tiny-hub"


@pytest.fixture
def world(control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]],
          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EnginePool, Path]]:
    ckpt = tiny_llama(tmp_path / MODEL, layers=2, hidden=64, vocab=512)
    hub = HubServer()
    hub.add("kascade/tiny", ckpt, token=HF_TOKEN)
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the engine processes inherit these (the pool pod's env)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    pool = EnginePool(control_plane, namespace, ckpt, MODEL, TOKEN, tmp_path / "engines")
    op = OperatorProcess(control_plane, namespace, TOKEN, tmp_path / "operator.log")
    try:
        pool.start(kwok_nodes(1))
        op.start()
        yield pool, ckpt
    finally:
        op.stop()
        print(op.tail(6000))
        pool.stop()
        hub.stop()


def kget(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def cond(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def test_hub_source_failure_is_named_then_fixed_in_place(control_plane: ControlPlane, namespace: str,
                                                         world: tuple[EnginePool, Path]) -> None:
    cp, ns = control_plane, namespace
    pool, ckpt = world
    doc = {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "svc"},
           "spec": {"model": {"name": MODEL, "source": {"uri": "hf://kascade/missing"}, "layers": 2},
                    "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 1, "max": 1}},
                    "scaling": {"intervalSeconds": 0.2}}}
    cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))
    obj = wait_for(lambda: (o := kget(cp, ns, "msvc", "svc")) and cond(o, "Stalled").get("status") == "True"
                   and cond(o, "Stalled").get("reason") == "SourceUnavailable" and o,
                   120, "Stalled: the Hub has no such repository")
    st = cond(obj, "Stalled")
    assert st["reason"] == "SourceUnavailable", st
    assert st["message"].startswith("spec.model.source.uri: ") and "hf://kascade/missing@main" in st["message"]
    assert "not found" in st["message"]
    events = wait_for(lambda: [e for e in kget(cp, ns, "events")["items"] if e["reason"] == "TargetDropped"
                               and e["involvedObject"]["name"] == "svc"], 60, "a TargetDropped Event")
    assert "spec.model.source.uri" in events[0]["message"] and "hf://kascade/missing" in events[0]["message"]

    doc["spec"]["model"]["source"] = {"uri": "hf://kascade/tiny"}
    cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))
    obj = wait_for(lambda: (o := kget(cp, ns, "msvc", "svc")) and cond(o, "Ready").get("status") == "True" and o,
                   180, "Ready once the URI names the Hub's repository")
    assert cond(obj, "Stalled")["status"] == "False"
    (engine,) = pool.engines.values()
    h = {"Authorization": f"Bearer {TOKEN}"}
    status = httpx.get(engine.url + "/kascade/v1/status", headers=h, timeout=30).json()
    assert status["phase"] == "serving" and status["modelService"].endswith("svc")
    assert httpx.get(engine.url + "/kascade/v1/manifest", headers=h, timeout=30).json() == \
        pack_checkpoint(ckpt, model=MODEL).manifest()  # the bytes the Hub served are the checkpoint's
    r = httpx.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
