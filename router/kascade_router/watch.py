"""The router's only Kubernetes API caller: list-then-watch ModelServices and bound engine pods into
`Routes`. No polling per request: the table changes when the API server says something changed.

Data flow: kubernetes_asyncio (in-cluster service account, else KUBECONFIG) -> LIST (raw JSON, the
resourceVersion to watch from) -> `Routes` replaced for that kind -> WATCH from there: each
ADDED/MODIFIED/DELETED line -> `Routes.set_*` / `remove_*`. A watch that ends is resumed from the last
resourceVersion; 410 Gone (too old) or any error re-lists after a short back-off. `synced` is set once
both kinds have been listed (the router's /readyz).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client, config

from kascade_router.backends import MODEL_SERVICE, Routes, service_model

log = logging.getLogger(__name__)
GROUP, VERSION = "kascade.io", "v1alpha1"
ListCall = Callable[..., Awaitable[Any]]


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class Watcher:
    def __init__(self, routes: Routes, namespace: str | None) -> None:
        self.routes, self.ns = routes, namespace
        self.synced = asyncio.Event()
        self._listed: set[str] = set()
        self._api: client.ApiClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, kubeconfig: str | None = None) -> None:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            cfg = None
        except config.ConfigException:
            cfg = client.Configuration()
            await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self._api = client.ApiClient(configuration=cfg)
        core, custom = client.CoreV1Api(self._api), client.CustomObjectsApi(self._api)
        ns = self.ns
        if ns:
            pods: ListCall = lambda **kw: core.list_namespaced_pod(ns, **kw)  # noqa: E731
            svcs: ListCall = lambda **kw: custom.list_namespaced_custom_object(  # noqa: E731
                GROUP, VERSION, ns, "modelservices", **kw)
        else:
            pods = core.list_pod_for_all_namespaces
            svcs = lambda **kw: custom.list_cluster_custom_object(GROUP, VERSION, "modelservices", **kw)  # noqa: E731
        self._tasks = [asyncio.create_task(self._run("modelservices", svcs, self._svc_reset, self._svc_event)),
                       asyncio.create_task(self._run("pods", lambda **kw: pods(label_selector=MODEL_SERVICE, **kw),
                                                     self._pod_reset, self._pod_event))]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._api is not None:
            await self._api.close()

    # -- ModelServices and pods into the table ---------------------------------------------------------
    def _svc_reset(self, items: list[dict[str, Any]]) -> None:
        keep = {(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items}
        for key in [k for k in self.routes.models.values() if k not in keep]:
            self.routes.remove_service(*key)
        for i in items:
            self._svc_event("ADDED", i)

    def _svc_event(self, kind: str, obj: dict[str, Any]) -> None:
        m = obj["metadata"]
        if kind == "DELETED":
            self.routes.remove_service(m["namespace"], m["name"])
        else:
            self.routes.set_service(m["namespace"], m["name"], service_model(obj))

    def _pod_reset(self, items: list[dict[str, Any]]) -> None:
        keep = {(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items}
        for ns, name in [k for k in self.routes.pod_keys() if k not in keep]:
            self.routes.remove_pod(ns, name)
        for i in items:
            self.routes.set_pod(i)

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        m = obj["metadata"]
        if kind == "DELETED":
            self.routes.remove_pod(m["namespace"], m["name"])
        else:
            self.routes.set_pod(obj)

    # -- list, then watch from its resourceVersion -----------------------------------------------------
    async def _run(self, what: str, call: ListCall, reset: Callable[[list[dict[str, Any]]], None],
                   event: Callable[[str, dict[str, Any]], None]) -> None:
        backoff = 0.2
        while True:
            try:
                resp = await call(_preload_content=False)
                doc = json.loads(await resp.read())
                rv = (doc.get("metadata") or {}).get("resourceVersion")
                if doc.get("kind") == "Status" or not rv:  # e.g. 404 while the CRD is not established yet
                    raise RuntimeError(
                        f"list {what}: {doc.get('message') or doc.get('reason') or 'no resourceVersion'}"
                    )
                reset(list(doc.get("items") or []))
                self._listed.add(what)
                if self._listed >= {"pods", "modelservices"}:
                    self.synced.set()
                log.info("watching %s from resourceVersion %s (%d listed)", what, rv, len(doc.get("items") or []))
                backoff = 0.2
                while True:
                    rv = await self._watch(call, rv, event)
            except asyncio.CancelledError:
                raise
            except Gone:
                log.info("%s watch expired; listing again", what)
            except Exception as e:  # the API server restarting, a network blip: list again shortly
                log.warning("%s watch failed (%s: %s); listing again in %.1f s", what, type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _watch(self, call: ListCall, rv: str, event: Callable[[str, dict[str, Any]], None]) -> str:
        resp = await call(
            watch=True, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=300, _preload_content=False
        )
        try:
            async for line in resp.content:
                if not line.strip():
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                if kind != "BOOKMARK":
                    event(str(kind), obj)
        finally:
            resp.release()
        return rv
