"""The front door's Grafana dashboard against a real Prometheus scraping a real router: every query of
charts/kascade/files/dashboards/kascade-router.json returns data (not only NaN) once requests flowed,
including a request held while the model had no serving replica. The router runs in this process with
a static backend (a stub engine: the router's metrics are what is tested)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.prometheus import MissingPrometheus, PrometheusServer, prometheus_binary
from kascade_devcluster.requirement import unavailable
from kascade_devcluster.stubengine import StubEngine
from kascade_router.backends import Routes
from kascade_router.server import Router
from kascade_router.settings import RouterSettings

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kascade" / "files" / "dashboards" / "kascade-router.json"
LOADED = {"kascade.io/loaded": "true"}


def queries(namespace: str, window: str) -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for t in panel["targets"]:
            expr = t["expr"].replace("$namespace", namespace).replace("$model_service", ".*") \
                .replace("$__rate_interval", window)
            assert "$" not in expr, expr
            out.append((panel["title"], expr))
    return out


async def test_router_dashboard_queries_return_data(tmp_path: Path) -> None:
    try:
        prometheus_binary()
    except MissingPrometheus as e:
        unavailable(str(e))
    eng = await StubEngine(name="e0", tokens=3).start()
    routes = Routes()
    routes.set_service("ns1", "chat", "tiny")
    r = await Router(RouterSettings(hold_timeout_s=30.0), routes).start()
    prom = PrometheusServer(tmp_path / "prometheus")
    url = f"http://127.0.0.1:{r.port}/v1/completions"
    try:
        # the chart's router ServiceMonitor: honorLabels (the series name the ModelService's namespace)
        await asyncio.to_thread(prom.start, [{"job_name": "kascade-router", "honor_labels": True,
                                              "static_configs": [{"targets": [f"127.0.0.1:{r.port}"]}]}])
        async with aiohttp.ClientSession() as s:
            held = asyncio.create_task(s.post(url, json={"model": "tiny", "prompt": "x"}))
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(prom.query, 'kascade_router_queued_requests{namespace="ns1"} > 0'):
                assert time.monotonic() < deadline, "Prometheus never saw the held request"
                await asyncio.sleep(0.2)
            routes.set_pod(
                {
                    "metadata": {
                        "namespace": "ns1",
                        "name": "e0",
                        "labels": {"kascade.io/model-service": "chat"},
                        "annotations": {"kascade.io/endpoint": eng.address, **LOADED},
                    },
                    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
                }
            )  # the watch sees it
            assert (await held).status == 200
            for i in range(20):
                async with s.post(url, json={"model": "tiny", "prompt": "hello", "stream": i % 2 == 0}) as resp:
                    assert resp.status == 200
                    await resp.read()
        empty: list[tuple[str, str]] = []
        nan_only: list[tuple[str, str]] = []
        for title, expr in queries("ns1", "1m"):
            deadline = time.monotonic() + 30  # a couple of scrapes after the requests: rates need two samples
            result: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                result = await asyncio.to_thread(prom.query, expr)
                if result and any(not math.isnan(float(x["value"][1])) for x in result):
                    break
                await asyncio.sleep(0.5)
            if not result:
                empty.append((title, expr))
            elif all(math.isnan(float(x["value"][1])) for x in result):
                nan_only.append((title, expr))
        assert not empty, f"front door dashboard queries without data: {empty}"
        assert not nan_only, f"front door dashboard queries with only NaN: {nan_only}"
        codes = await asyncio.to_thread(prom.query, 'sum by (code) (kascade_router_requests_total{namespace="ns1"})')
        assert {x["metric"]["code"]: float(x["value"][1]) for x in codes} == {"200": 21.0}
    finally:
        await asyncio.to_thread(prom.stop)
        await r.close()
        await eng.close()


@pytest.mark.parametrize("name", ["kascade.json", "kascade-router.json"])
def test_dashboards_link_each_other(name: str) -> None:
    doc = json.loads(DASHBOARD.with_name(name).read_text())
    assert doc["links"][0]["tags"] == ["kascade"] and "kascade" in doc["tags"]
