"""The serving readiness gate (kascade.io/serving): the operator opens it only while a pool pod is bound
and loaded or live, closes it when a drain starts or the pod goes back to the pool; the router (and any
kubelet-computed Ready) follows it. Pure rules first, then the real API server: the operator's writes
through `Kube`, a real router watching the namespace, a stub engine behind the pod."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.stubengine import StubEngine
from kascade_operator import labels as L
from kascade_operator import serving_gate as G
from kascade_operator.kube import Kube
from kascade_router import backends as RB
from kascade_router.server import Router


def pod(ann: dict[str, str] | None = None, bound: bool = True, gate: str | None = None,
        declares: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": "p", "labels": {L.MODEL_SERVICE: "ns.svc"} if bound else {},
                         "annotations": ann or {}},
            "spec": {"readinessGates": [{"conditionType": G.GATE}] if declares else []},
            "status": {"conditions": [{"type": G.GATE, "status": gate}] if gate else []}}


def test_gate_name_is_the_routers() -> None:
    assert G.GATE == RB.SERVING_GATE


@pytest.mark.parametrize(("ann", "bound", "want"), [
    ({L.LOADED: "true"}, True, True),
    ({L.LIVE: "true"}, True, True),
    ({}, True, False),  # bound, loading alone
    ({L.LOADED: "true"}, False, False),  # back in the pool
    ({L.LOADED: "true", L.DRAINING: "2026-01-01T00:00:00Z"}, True, False),
    ({L.LIVE: "true", L.UNHEALTHY: "unreachable"}, True, False),
])
def test_open_only_while_bound_and_serving(ann: dict[str, str], bound: bool, want: bool) -> None:
    assert G.wanted(pod(ann, bound)) is want


def test_serving_label_follows_the_same_decision_on_every_pod() -> None:
    """Chart 0.4 pool pods declare no gate (idle ones must be Ready): the label carries the decision."""
    loaded = {L.LOADED: "true"}
    assert G.label_pending([pod(loaded, declares=False)]) == [("p", True)]
    labelled = pod(loaded, declares=False)
    labelled["metadata"]["labels"][G.SERVING_LABEL] = "true"
    assert G.label_pending([labelled]) == []
    labelled["metadata"]["annotations"][L.DRAINING] = "now"
    assert G.label_pending([labelled]) == [("p", False)]
    assert G.label_pending([pod({}, bound=False, declares=False)]) == []  # idle: no label, nothing to write
    assert G.label_patch(False) == {"metadata": {"labels": {G.SERVING_LABEL: None}}}


def test_pending_writes_only_differences_on_pods_that_declare_the_gate() -> None:
    loaded = {L.LOADED: "true"}
    assert G.pending([pod(loaded)]) == [("p", True)]  # never written: closed
    assert G.pending([pod(loaded, gate="True")]) == []
    assert G.pending([pod({}, gate="True")]) == [("p", False)]  # KWOK (or a stale write) opened it
    assert G.pending([pod({}, gate=None)]) == []  # closed is what a kubelet assumes: nothing to write
    assert G.pending([pod(loaded, declares=False)]) == []
    patch = G.gate_patch(False, "Draining")["status"]["conditions"]
    assert [(c["type"], c["status"], c["reason"]) for c in patch] == [(G.GATE, "False", "Draining")]


@pytest.mark.cluster
async def test_operator_gate_decides_what_the_router_routes(
    control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]]
) -> None:
    cp, ns = control_plane, namespace
    node = kwok_nodes(1)[0]
    eng = await StubEngine(name="e0").start()
    kube = await Kube.connect(str(cp.kubeconfig))
    r = await Router(namespace=ns, kubeconfig=str(cp.kubeconfig)).start()

    def kubectl(*args: str, doc: Any = None) -> None:
        cp.kubectl("-n", ns, *args, input=json.dumps(doc) if doc is not None else None)

    def labels() -> dict[str, str]:
        return dict(json.loads(cp.kubectl("-n", ns, "get", "pod", "e0", "-o", "json").stdout)["metadata"]["labels"])

    def conds() -> dict[str, str]:
        got = json.loads(cp.kubectl("-n", ns, "get", "pod", "e0", "-o", "json").stdout)
        return {c["type"]: c["status"] for c in got["status"].get("conditions") or []}

    async def routed(want: bool, what: str) -> None:
        t0 = time.monotonic()
        while bool(r.routes.serving((ns, "chat"))) is not want:
            assert time.monotonic() - t0 < 30, f"router: {what}"
            await asyncio.sleep(0.02)

    async def pods() -> list[dict[str, Any]]:
        return await kube.list_pods(ns, L.MODEL_SERVICE)

    try:
        await r.wait_synced(20)
        kubectl("apply", "-f", "-", doc={"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService",
                                         "metadata": {"name": "chat"},
                                         "spec": {"model": {"name": "tiny", "source": {"path": "/m"}},
                                                  "engine": {"image": "kascade:dev"},
                                                  "replicas": {"colocated": {"min": 1, "max": 2}}}})
        kubectl("apply", "-f", "-", doc={
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "e0", "labels": {L.MODEL_SERVICE: "chat", L.POOL: "bound"},
                         "annotations": {L.ENDPOINT: eng.address, L.LOADED: "true"}},
            "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "kascade:dev"}],
                     "readinessGates": [{"conditionType": G.GATE}],
                     "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]}})
        t0 = time.monotonic()
        while conds().get("Ready") != "True":  # KWOK's stand-in kubelet (it also opens every gate it sees)
            assert time.monotonic() - t0 < 30, conds()
            await asyncio.sleep(0.1)
        # the operator's round: bound + loaded -> open (KWOK opened it already: nothing to write)
        kubectl("annotate", "pod", "e0", f"{L.DRAINING}=now")  # a drain starts
        await G.close(kube, ns, await pods(), "e0")
        assert conds()[G.GATE] == "False" and conds()["Ready"] == "True"  # Ready alone is not enough
        assert G.SERVING_LABEL not in labels()  # never written while KWOK had the gate open: nothing to drop
        await routed(False, "a pod with a closed gate is not routed")
        kubectl("annotate", "pod", "e0", f"{L.DRAINING}-")  # the drain is called off: the round reopens it
        t0 = time.monotonic()
        while G.pending(await pods()) != [("e0", True)]:
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.05)
        assert await G.sync(kube, ns, await pods()) == 2  # the gate, and the serving label Services select
        assert conds()[G.GATE] == "True" and await G.sync(kube, ns, await pods()) == 0  # level-triggered: once
        assert labels()[G.SERVING_LABEL] == "true"
        await routed(True, "an open gate routes")
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{r.port}/v1/completions",
                                                         json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 200 and resp.headers["X-Kascade-Replica"] == "e0"
        kubectl("label", "pod", "e0", f"{L.MODEL_SERVICE}-")  # released back to the pool
        kubectl("annotate", "pod", "e0", f"{L.LOADED}-")
        t0 = time.monotonic()
        while G.pending(await kube.list_pods(ns, L.POOL)) != [("e0", False)]:
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.05)
        assert await G.sync(kube, ns, await kube.list_pods(ns, L.POOL)) == 2
        assert conds()[G.GATE] == "False" and G.SERVING_LABEL not in labels()
    finally:
        await r.close()
        await kube.close()
        await eng.close()
