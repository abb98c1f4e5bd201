"""The only module that talks to the Kubernetes API (kubernetes_asyncio).

Data flow: handlers / scaleplan driver -> `Kube` methods -> API server. Reads return plain dicts
(raw JSON, no model objects: cheap at 2,000 nodes); writes use JSON merge patches. A 409 on a guarded
patch (stale resourceVersion) becomes `Conflict`, so callers can re-read instead of double-binding.
Nodes are also listed with their list's resourceVersion and watched from it (`list_nodes_page`,
`watch_nodes`: nodefacts.py keeps them in memory); a 410 on the watch becomes `Gone` (list again).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import uuid
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

GROUP, VERSION = "kascade.io", "v1alpha1"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class Conflict(RuntimeError):
    """The object changed since it was read (HTTP 409): re-read and decide again."""


class NotFound(RuntimeError):
    pass


class Gone(RuntimeError):
    """HTTP 410 on a watch: the resourceVersion is older than the API server still keeps; list again."""


class NoCluster(RuntimeError):
    """Neither in a pod with a service account nor a usable kubeconfig: one line saying what was tried."""


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _raise(e: ApiException, what: str) -> None:
    if e.status == 409:
        raise Conflict(f"{what}: {e.reason}") from None
    if e.status == 404:
        raise NotFound(f"{what}: not found") from None
    raise e


def _watch_event(ev: dict[str, Any], since: str) -> tuple[str, dict[str, Any]]:
    """A watch line as (type, object); an ERROR event raises (`Gone` for 410: the version expired)."""
    kind, obj = str(ev.get("type")), dict(ev.get("object") or {})
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Gone(f"watch from {since}: {obj.get('message')}")
        raise RuntimeError(f"watch from {since}: {obj.get('code')} {obj.get('message')}")
    return kind, obj


WATCH_TIMEOUT_S = 300  # the server ends a watch after this (a new one starts from the last resourceVersion)
REQUEST_TIMEOUT_S = 30.0  # aiohttp's default is no timeout: one stuck call would wedge a plan's driver forever


class Kube:
    def __init__(self, api: client.ApiClient, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.api = api
        self.t = timeout_s  # every call passes it as _request_timeout
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    @staticmethod
    async def configuration(kubeconfig: str | None = None) -> client.Configuration | None:
        """In-cluster (None: the library's default) else the kubeconfig's; NoCluster names both sources."""
        try:
            config.load_incluster_config()
            return None
        except config.ConfigException as in_pod:
            cfg = client.Configuration()
            path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
            first = path.split(os.pathsep)[0]
            why = f"not in a pod ({in_pod})"
            if not os.path.exists(first):
                raise NoCluster(f"no Kubernetes cluster to talk to: {why} and no kubeconfig at {first}: set "
                                "KUBECONFIG or run in-cluster") from None
            try:
                await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            except Exception as e:  # config, YAML and file errors alike: whatever it is, one line naming the file
                raise NoCluster(f"no Kubernetes cluster to talk to: {why} and the kubeconfig {path} is not usable: "
                                f"{' '.join(str(e).split())}") from None
            return cfg

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        return cls(client.ApiClient(configuration=await cls.configuration(kubeconfig)))

    async def close(self) -> None:
        await self.api.close()

    @staticmethod
    async def _json(resp: Any, what: str = "request") -> Any:
        """The body of a raw (`_preload_content=False`) response. kubernetes_asyncio raises on an HTTP
        error only when it preloads the body: without this check a 409 on a guarded patch read as
        success (a bind that never happened, and a plan that waited for it forever)."""
        body = await resp.read()
        if not 200 <= resp.status <= 299:
            _raise(ApiException(status=resp.status, reason=resp.reason), what)
        return json.loads(body)

    @classmethod
    async def _done(cls, resp: Any, what: str) -> None:
        """Check and release a raw response whose body is not needed."""
        try:
            await cls._json(resp, what)
        finally:
            resp.release()

    # -- reads -----------------------------------------------------------------------------------
    async def list_nodes(self) -> list[dict[str, Any]]:
        doc = await self._json(await self.core.list_node(_preload_content=False, _request_timeout=self.t), "list nodes")
        return list(doc.get("items") or [])

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]:
        """One page of at most `limit` nodes: (items, the list's resourceVersion, continue token; "" on the
        last page). Pages, not one list: at 10,000 nodes one list is ~50 MB of JSON and several hundred MB
        of dicts at once, a peak the process keeps as RSS. A continue token that expired raises `Gone`."""
        resp = await self.core.list_node(limit=limit, _continue=cont or None, _preload_content=False,
                                         _request_timeout=self.t)
        if resp.status == 410:
            body = await resp.read()
            raise Gone(f"list nodes (continue): {resp.reason} {body[:200]!r}")
        doc = await self._json(resp, "list nodes")
        meta = doc.get("metadata") or {}
        return list(doc.get("items") or []), str(meta.get("resourceVersion") or ""), str(meta.get("continue") or "")

    async def watch_nodes(self, resource_version: str,
                          timeout_s: int = WATCH_TIMEOUT_S) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(type, node) for each change after `resource_version` (ADDED / MODIFIED / DELETED, and BOOKMARK:
        only a newer resourceVersion) until the server ends the watch after `timeout_s`. `Gone` on 410."""
        resp = await self.core.list_node(watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                                         timeout_seconds=timeout_s, _preload_content=False,
                                         _request_timeout=timeout_s + self.t)
        try:
            if resp.status == 410:
                raise Gone(f"watch nodes from {resource_version}: {resp.reason}")
            if not 200 <= resp.status <= 299:
                _raise(ApiException(status=resp.status, reason=resp.reason), "watch nodes")
            buf = b""  # lines split by hand: aiohttp's readline refuses lines over 128 KiB (a node's image list)
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _watch_event(json.loads(line), resource_version)
        finally:
            resp.release()

    async def list_pods(self, ns: str, selector: str = "") -> list[dict[str, Any]]:
        resp = await self.core.list_namespaced_pod(
            ns, label_selector=selector, _preload_content=False, _request_timeout=self.t
        )
        return list((await self._json(resp, f"list pods in {ns}")).get("items") or [])

    async def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        # raw calls (_preload_content=False) never raise on an HTTP status: _json does
        resp = await self.core.read_namespaced_pod(name, ns, _preload_content=False, _request_timeout=self.t)
        return dict(await self._json(resp, f"pod {ns}/{name}"))

    async def list_scaleplans(self, ns: str) -> list[dict[str, Any]]:
        doc = await self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, "scaleplans", _request_timeout=self.t)
        return list(doc.get("items") or [])

    async def list_modelserviceroles(self, ns: str) -> list[dict[str, Any]]:
        doc = await self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, "modelserviceroles",
                                                              _request_timeout=self.t)
        return list(doc.get("items") or [])

    async def get_modelservice(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return dict(await self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, "modelservices", name,
                                                                       _request_timeout=self.t))
        except ApiException as e:
            _raise(e, f"modelservice {ns}/{name}")
            raise

    async def get_scaleplan(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return dict(
                await self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, ns, "scaleplans", name, _request_timeout=self.t
                )
            )
        except ApiException as e:
            _raise(e, f"scaleplan {ns}/{name}")
            raise

    async def secret_value(self, ns: str, name: str, key: str = "token") -> str | None:
        try:
            s = await self.core.read_namespaced_secret(name, ns, _request_timeout=self.t)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (s.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    # -- writes ----------------------------------------------------------------------------------
    async def create_secret(self, ns: str, name: str, data: dict[str, str], labels: dict[str, str]) -> bool:
        """Create an Opaque Secret; False when it exists already (409). 403 -> PermissionError."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": ns, "labels": labels},
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}
        try:
            await self.core.create_namespaced_secret(ns, body, _request_timeout=self.t)
        except ApiException as e:
            if e.status == 409:
                return False
            if e.status == 403:
                raise PermissionError(f"create secret {ns}/{name}: forbidden ({e.reason})") from None
            raise
        return True

    async def patch_pod(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = await self.core.patch_namespaced_pod(name, ns, patch, _content_type=MERGE, _preload_content=False,
                                                    _request_timeout=self.t)
        return dict(await self._json(resp, f"pod {ns}/{name}"))

    async def patch_pod_status(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Strategic merge on the status subresource: conditions merge by type (the serving gate)."""
        resp = await self.core.patch_namespaced_pod_status(name, ns, patch, _content_type=STRATEGIC,
                                                           _preload_content=False, _request_timeout=self.t)
        return dict(await self._json(resp, f"pod {ns}/{name} status"))

    async def create_pod(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.core.create_namespaced_pod(ns, body, _preload_content=False, _request_timeout=self.t)
        return dict(await self._json(resp, f"create pod in {ns}"))

    async def create_scaleplan(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return dict(
                await self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, "scaleplans", body, _request_timeout=self.t
                )
            )
        except ApiException as e:
            _raise(e, f"scaleplan {ns}/{body['metadata'].get('name')}")
            raise

    async def delete_scaleplan(self, ns: str, name: str) -> None:
        try:
            await self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, ns, "scaleplans", name, _request_timeout=self.t
            )
        except ApiException as e:
            _raise(e, f"scaleplan {ns}/{name}")

    async def delete_pod(self, ns: str, name: str) -> None:
        await self._done(await self.core.delete_namespaced_pod(name, ns, _preload_content=False,
                                                               _request_timeout=self.t), f"pod {ns}/{name}")

    async def patch_scaleplan_status(self, ns: str, name: str, status: dict[str, Any],
                                     resource_version: str | None = None) -> None:
        """`resource_version`: write only if the plan is still at that version, else `Conflict` (a progress
        write built from what was read must never replace a newer, terminal one)."""
        await self._patch_status("scaleplans", ns, name, status, resource_version)

    async def patch_modelservice_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        await self._patch_status("modelservices", ns, name, status)

    async def patch_modelservicerole_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        await self._patch_status("modelserviceroles", ns, name, status)

    async def _patch_status(self, plural: str, ns: str, name: str, status: dict[str, Any],
                            resource_version: str | None = None) -> None:
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            await self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, plural, name, body,
                                                                    _content_type=MERGE, _request_timeout=self.t)
        except ApiException as e:
            _raise(e, f"{plural[:-1]} {ns}/{name} status")

    # -- Leases (shardlead.py: one per shard, one per replica) ------------------------------------
    async def list_leases(self, ns: str, selector: str) -> list[dict[str, Any]]:
        coord = client.CoordinationV1Api(self.api)
        doc = await self._json(await coord.list_namespaced_lease(ns, label_selector=selector, _preload_content=False,
                                                                 _request_timeout=self.t), f"list leases in {ns}")
        return list(doc.get("items") or [])

    async def delete_lease(self, ns: str, name: str) -> None:
        coord = client.CoordinationV1Api(self.api)
        await self._done(await coord.delete_namespaced_lease(name, ns, _preload_content=False,
                                                             _request_timeout=self.t), f"lease {ns}/{name}")

    async def write_lease(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the Lease, or replace it when `body` carries the resourceVersion read (guarded: `Conflict` when
        someone wrote it since, or created it first)."""
        coord, name = client.CoordinationV1Api(self.api), body["metadata"]["name"]
        if body["metadata"].get("resourceVersion"):
            resp = await coord.replace_namespaced_lease(name, ns, body, _preload_content=False,
                                                        _request_timeout=self.t)
        else:
            resp = await coord.create_namespaced_lease(ns, body, _preload_content=False, _request_timeout=self.t)
        return dict(await self._json(resp, f"lease {ns}/{name}"))

    async def event(self, ns: str, obj: dict[str, Any], kind: str, etype: str, reason: str, message: str,
                    api_version: str = f"{GROUP}/{VERSION}") -> None:
        """A core/v1 Event on `obj` (a ModelService or ScalePlan, or of `api_version`: the operator's Deployment);
        failures are logged, never raised."""
        meta = obj.get("metadata") or {}
        t = now_iso()
        body = {"metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:12]}", "namespace": ns},
                "involvedObject": {"apiVersion": api_version, "kind": kind, "name": meta.get("name"),
                                   "namespace": ns, "uid": meta.get("uid")},
                "type": etype, "reason": reason, "message": message[:1024], "firstTimestamp": t, "lastTimestamp": t,
                "eventTime": t, "count": 1, "reportingComponent": "kascade-operator",
                "reportingInstance": "kascade-operator", "action": reason,
                "source": {"component": "kascade-operator"}}
        try:
            await self._done(await self.core.create_namespaced_event(ns, body, _preload_content=False,
                                                                     _request_timeout=self.t), f"event in {ns}")
        except (ApiException, Conflict, NotFound, TimeoutError) as e:
            log.warning(
                "event %s on %s/%s not posted: %s", reason, ns, meta.get("name"), getattr(e, "reason", None) or repr(e)
            )
