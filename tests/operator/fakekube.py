"""The in-process test seam: an in-memory stand-in for `kascade_operator.kube.Kube` (the operator's only
API caller), so reconcile rounds and the ScalePlan driver run in a test without an API server.

It keeps what the real one does that the operator relies on: JSON merge patches (null deletes a key),
resourceVersion guards (a stale `metadata.resourceVersion` in a patch -> Conflict), generateName,
NotFound, label selectors of the form `key` / `key=value`. It does not schedule, garbage-collect or
validate schemas: the real-cluster tests cover those.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncGenerator
from typing import Any

from kascade_operator.kube import Conflict, Gone, NotFound

GONE: tuple[str, dict[str, Any]] = ("GONE", {})  # put on `node_events`: the watch answers 410 (its version expired)
END: tuple[str, dict[str, Any]] = ("END", {})  # put on `node_events`: the server ends the watch


def merge(dst: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for k, v in patch.items():
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        k, _, v = term.partition("=")
        if k not in labels or (v and labels[k] != v):
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.plans: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.nodes: list[dict[str, Any]] = []
        self.node_events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()  # what watch_nodes yields
        self.node_lists = 0
        self.node_watches: list[str] = []  # the resourceVersion each watch started from
        self._rv = itertools.count(1)
        self._list_rv = ""  # the resourceVersion of the node list being paged
        self._names = itertools.count(1)

    def _stamp(self, obj: dict[str, Any], ns: str) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if "name" not in meta:
            meta["name"] = f"{meta.get('generateName', 'obj-')}{next(self._names):05d}"
        meta["namespace"] = ns
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._rv))
        return obj

    # -- what Kube offers ------------------------------------------------------------------------
    async def list_nodes(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.nodes)

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]:
        """As the API server pages: the continue token is the next item's index; one resourceVersion per list."""
        start = int(cont or 0)
        if not start:
            self.node_lists += 1
            self._list_rv = str(next(self._rv))
        end = start + limit
        return copy.deepcopy(self.nodes[start:end]), self._list_rv, str(end) if end < len(self.nodes) else ""

    async def watch_nodes(self, resource_version: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The events put on `node_events` (a test writes them, and `self.nodes` for the next list)."""
        self.node_watches.append(resource_version)
        while True:
            kind, obj = await self.node_events.get()
            if (kind, obj) == GONE:
                raise Gone(f"watch nodes from {resource_version}: too old")
            if (kind, obj) == END:
                return
            yield kind, copy.deepcopy(obj)

    async def list_pods(self, ns: str, selector: str = "") -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for (n, _), p in self.pods.items() if n == ns and _matches(p, selector)]

    async def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self.pods:
            raise NotFound(f"pod {ns}/{name}: not found")
        return copy.deepcopy(self.pods[(ns, name)])

    async def list_modelserviceroles(self, ns: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (n, _), o in getattr(self, "roles", {}).items() if n == ns]

    async def patch_modelservicerole_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        roles = getattr(self, "roles", {})
        if (ns, name) not in roles:
            raise NotFound(f"modelservicerole {ns}/{name}")
        roles[(ns, name)]["status"] = merge(roles[(ns, name)].get("status") or {}, status)

    async def list_scaleplans(self, ns: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for (n, _), p in self.plans.items() if n == ns]

    async def get_scaleplan(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self.plans:
            raise NotFound(f"scaleplan {ns}/{name}: not found")
        return copy.deepcopy(self.plans[(ns, name)])

    async def secret_value(self, ns: str, name: str, key: str = "token") -> str | None:
        return None

    async def patch_pod(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        pod = self.pods.get((ns, name))
        if pod is None:
            raise NotFound(f"pod {ns}/{name}: not found")
        want = (patch.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != pod["metadata"]["resourceVersion"]:
            raise Conflict(f"pod {ns}/{name}: resourceVersion {want} is stale")
        patch = copy.deepcopy(patch)
        patch.get("metadata", {}).pop("resourceVersion", None)
        merge(pod, patch)
        pod["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(pod)

    async def patch_pod_status(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        pod = self.pods.get((ns, name))
        if pod is None:
            raise NotFound(f"pod {ns}/{name}")
        conds = {c["type"]: c for c in pod.setdefault("status", {}).get("conditions") or []}
        conds.update({c["type"]: c for c in patch["status"].get("conditions") or []})  # strategic: merge by type
        pod["status"]["conditions"] = list(conds.values())
        return pod

    async def create_pod(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        pod = self._stamp(copy.deepcopy(body), ns)
        self.pods[(ns, pod["metadata"]["name"])] = pod
        return copy.deepcopy(pod)

    async def delete_pod(self, ns: str, name: str) -> None:
        if self.pods.pop((ns, name), None) is None:
            raise NotFound(f"pod {ns}/{name}: not found")

    async def create_scaleplan(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        sp = self._stamp(copy.deepcopy(body), ns)
        self.plans[(ns, sp["metadata"]["name"])] = sp
        return copy.deepcopy(sp)

    async def delete_scaleplan(self, ns: str, name: str) -> None:
        if self.plans.pop((ns, name), None) is None:
            raise NotFound(f"scaleplan {ns}/{name}: not found")

    async def patch_scaleplan_status(self, ns: str, name: str, status: dict[str, Any],
                                     resource_version: str | None = None) -> None:
        sp = self.plans.get((ns, name))
        if sp is None:
            raise NotFound(f"scaleplan {ns}/{name}: not found")
        if resource_version is not None and resource_version != sp["metadata"]["resourceVersion"]:
            raise Conflict(f"scaleplan {ns}/{name}: resourceVersion {resource_version} is stale")
        merge(sp.setdefault("status", {}), status)
        sp["metadata"]["resourceVersion"] = str(next(self._rv))  # as the API server: every write is a version

    async def patch_modelservice_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        self.service_status = merge(getattr(self, "service_status", {}), status)

    async def event(self, ns: str, obj: dict[str, Any], kind: str, etype: str, reason: str, message: str,
                    api_version: str = "kascade.io/v1alpha1") -> None:
        self.events.append({"namespace": ns, "name": (obj.get("metadata") or {}).get("name"), "kind": kind,
                            "apiVersion": api_version, "uid": (obj.get("metadata") or {}).get("uid"),
                            "type": etype, "reason": reason, "message": message})

    async def close(self) -> None:
        pass

    # -- test helpers ----------------------------------------------------------------------------
    def add_pool_pod(self, ns: str, name: str, node: str, endpoint: str, model: str | None = None) -> None:
        ann = {"kascade.io/endpoint": endpoint, **({"kascade.io/model": model} if model else {})}
        self.pods[(ns, name)] = self._stamp({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"kascade.io/pool": "warm"}, "annotations": ann},
            "spec": {"nodeName": node, "containers": [{"name": "engine"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, ns)
