"""The router's watch on the real API server: ModelServices and pods created, annotated, drained and
deleted with kubectl; the router's table follows within a fraction of a second (no polling), and
requests go only to pods that are Ready, bound, loaded (or live) and not draining. Engines are HTTP
stubs here (the router is what is tested; tests/e2e route real engines through it)."""

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
from kascade_router.server import Router

pytestmark = [pytest.mark.cluster]


def engine_pod(name: str, node: str, addr: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"kascade.io/model-service": "chat", "kascade.io/pool": "bound"},
                         "annotations": {"kascade.io/endpoint": addr}},
            "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "kascade:dev"}],
                     "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]}}


async def until(pred: Callable[[], Any], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"router did not see {what} within {timeout} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_router_follows_the_cluster_by_watching(control_plane: ControlPlane, crds: list[str], namespace: str,
                                                      kwok_nodes: Callable[..., list[str]]) -> None:
    cp, ns = control_plane, namespace
    node = kwok_nodes(1)[0]
    engines = [await StubEngine(name=f"e{i}", delay_s=0.02).start() for i in range(2)]
    r = await Router(namespace=ns, kubeconfig=str(cp.kubeconfig)).start()
    url = f"http://127.0.0.1:{r.port}/v1/completions"

    def kubectl(*args: str, doc: Any = None) -> None:
        cp.kubectl("-n", ns, *args, input=json.dumps(doc) if doc is not None else None)

    try:
        await r.wait_synced(20)
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 404 and "model 'tiny' is not served here" in await resp.text()
            kubectl("apply", "-f", "-", doc={"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService",
                                             "metadata": {"name": "chat"},
                                             "spec": {"model": {"name": "tiny", "source": {"path": "/m"}},
                                                      "engine": {"image": "kascade:dev"},
                                                      "replicas": {"colocated": {"min": 1, "max": 2}}}})
            await until(lambda: r.routes.lookup("tiny") == (ns, "chat"), 10, "the ModelService")
            for i, e in enumerate(engines):
                kubectl("apply", "-f", "-", doc=engine_pod(f"engine-{i}", node, e.address))
            # bound but loading: Ready (KWOK) yet not routed
            await asyncio.sleep(0.5)
            assert r.routes.serving((ns, "chat")) == []
            kubectl("annotate", "pod", "engine-0", "kascade.io/loaded=true")
            kubectl("annotate", "pod", "engine-1", "kascade.io/live=true")
            lag = await until(lambda: len(r.routes.serving((ns, "chat"))) == 2, 10, "two serving pods")
            async def one() -> int:
                async with s.post(url, json={"model": "tiny", "prompt": "x"}) as resp:
                    return resp.status

            assert await asyncio.gather(*(one() for _ in range(30))) == [200] * 30
            # concurrent load spills onto the live replica; it weighs less than the loaded one
            assert len(engines[0].seen) > len(engines[1].seen) > 0
            kubectl("annotate", "pod", "engine-0", "kascade.io/draining=now")
            drain_lag = await until(lambda: [b.pod for b in r.routes.serving((ns, "chat"))] == ["engine-1"], 10,
                                    "the drain")
            before = len(engines[0].seen)
            for _ in range(5):
                async with s.post(url, json={"model": "tiny", "prompt": "x"}) as resp:
                    assert resp.status == 200
            assert len(engines[0].seen) == before  # a draining pod never gets a new request
            kubectl("delete", "pod", "engine-1", "--wait=false")
            await until(lambda: r.routes.serving((ns, "chat")) == [], 10, "the deletion")
        print(f"watch lag: annotate -> routed {lag * 1000:.0f} ms, drain -> unrouted {drain_lag * 1000:.0f} ms")
        assert drain_lag < 2.0
    finally:
        await r.close()
        for e in engines:
            await e.close()
