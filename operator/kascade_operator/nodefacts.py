"""The nodes as the operator needs them, kept in memory by a plain list + watch (not a kopf index).

Why not kopf: kopf gates every handler on all of its indexes being filled, and each object's worker waits on
one condition that is notified whenever one more object is indexed: O(objects^2) at start-up. At 2,000
nodes that was minutes before the first round (and so the failover time of a standby at that size). The
operator reads only each node's labels (the topology's leaf) and its GPU counts, so a list and a watch of
the changes after it are all it needs.

What is kept: per node its name, labels, allocatable and capacity (`slim`), the same shape
`scaleplan.build` and `validation.max_gpus` read. A watch event that changes none of those (a status
heartbeat) changes nothing here. `facts()` is (node -> leaf label, most GPUs on a node), rebuilt only after
a change; its leaf dict is the same object while the leaves are unchanged, which the pool snapshot
(snapshots.cached) relies on to stay valid.

Data flow: `run(kube)`: `kube.list_nodes_page()` page by page, each page slimmed before the next is read
(`list_all`) -> `replace()` (sets `ready`) -> `kube.watch_nodes(rv)` ->
`apply()` per event, the resourceVersion advancing with each (bookmarks too); a watch the server ends is
started again from the last version; `Gone` (410: that version expired) -> list again; any other failure
-> wait (backoff) and go on from the last version. Readers: Runtime.nodes() / Runtime.node_facts(), which
wait for `ready` (the first rounds never see an empty cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Protocol

from kascade_operator.kube import Gone
from kascade_operator.validation import max_gpus

log = logging.getLogger(__name__)

LIST_PAGE = 500  # nodes per list request (kube.list_nodes_page: the full bodies of one page at a time)
BACKOFF_S, BACKOFF_MAX_S = 0.5, 30.0  # after a failed list or watch: doubled per failure, reset by a good one


class NodeSource(Protocol):
    """What of `kube.Kube` the node facts use (the test seam's FakeKube has the same two)."""

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]: ...

    def watch_nodes(self, resource_version: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]: ...


def slim(node: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a node."""
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    return {"metadata": {"name": str(meta.get("name")), "labels": dict(meta.get("labels") or {})},
            "status": {"allocatable": dict(status.get("allocatable") or {}),
                       "capacity": dict(status.get("capacity") or {})}}


class NodeFacts:
    def __init__(self, leaf_label: str, gpu_resource: str) -> None:
        self.leaf_label, self.gpu_resource = leaf_label, gpu_resource
        self.nodes: dict[str, dict[str, Any]] = {}  # name -> slim node
        self.resource_version = ""  # "": list (again) before watching
        self.ready = asyncio.Event()  # set by the first complete list
        self.lists = 0  # lists done (1 + re-lists after a 410)
        self._list: list[dict[str, Any]] | None = None  # None: changed since last read
        self._facts: tuple[dict[str, str], int] | None = None
        self._leaf: dict[str, str] = {}

    # -- writes (from the list and the watch) --------------------------------------------------------
    def replace(self, items: list[dict[str, Any]], resource_version: str, slimmed: bool = False) -> None:
        """A complete list (`slimmed`: already `slim`): nodes not in it are gone."""
        nodes = {n["metadata"]["name"]: n for n in (items if slimmed else map(slim, items))}
        if nodes != self.nodes:
            self.nodes = nodes
            self._changed()
        self.resource_version, self.lists = resource_version, self.lists + 1
        self.ready.set()

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """One watch event."""
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            node = slim(obj)
            name = node["metadata"]["name"]
            if self.nodes.get(name) != node:
                self.nodes[name] = node
                self._changed()
        elif kind == "DELETED":
            if self.nodes.pop(str((obj.get("metadata") or {}).get("name")), None) is not None:
                self._changed()
        elif kind != "BOOKMARK":
            log.warning("node watch: unknown event type %r ignored", kind)
        if rv:
            self.resource_version = str(rv)

    def _changed(self) -> None:
        self._list, self._facts = None, None

    # -- reads ---------------------------------------------------------------------------------------
    def node_list(self) -> list[dict[str, Any]]:
        """Every node (slim), the same list object until a node changes (callers must not modify it)."""
        if self._list is None:
            self._list = list(self.nodes.values())
        return self._list

    def facts(self) -> tuple[dict[str, str], int]:
        """(node -> leaf label, most GPUs on a node); the leaf dict is the same object while it is unchanged."""
        if self._facts is None:
            nodes = self.node_list()
            leaf = {n["metadata"]["name"]: n["metadata"]["labels"].get(self.leaf_label, "") for n in nodes}
            if leaf == self._leaf:
                leaf = self._leaf
            self._leaf = leaf
            self._facts = (leaf, max_gpus(nodes, self.gpu_resource))
        return self._facts

    # -- the loop ------------------------------------------------------------------------------------
    async def list_all(self, kube: NodeSource) -> str:
        """List every node page by page, keeping only each page's slim nodes (a full page is dropped before
        the next is read); then `replace` with them. Returns the list's resourceVersion."""
        slimmed: list[dict[str, Any]] = []
        cont, rv = "", ""
        while True:
            items, rv, cont = await kube.list_nodes_page(LIST_PAGE, cont)
            slimmed.extend(map(slim, items))
            del items
            if not cont:
                break
        self.replace(slimmed, rv, slimmed=True)
        return rv

    async def run(self, kube: NodeSource) -> None:
        """List, then watch from the list's version, for ever (cancel to stop)."""
        backoff = BACKOFF_S
        while True:
            try:
                if not self.resource_version:
                    rv = await self.list_all(kube)
                    log.info("nodes listed: %d at resourceVersion %s", len(self.nodes), rv)
                t0, seen = time.monotonic(), 0
                async with contextlib.aclosing(kube.watch_nodes(self.resource_version)) as events:
                    async for kind, obj in events:
                        self.apply(kind, obj)
                        seen += 1
                if seen or time.monotonic() - t0 > 1.0:
                    backoff = BACKOFF_S
                else:  # a watch that ends at once, empty, again and again: do not spin
                    await asyncio.sleep(backoff)
                    backoff = min(BACKOFF_MAX_S, 2 * backoff)
            except Gone as e:  # the version expired (compaction, a long disconnect): a fresh list
                log.info("node watch: %s; listing the nodes again", e)
                self.resource_version = ""
            except Exception as e:
                log.warning("node watch failed (retrying in %.1f s): %r", backoff, e)
                await asyncio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, 2 * backoff)
