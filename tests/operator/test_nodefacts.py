"""nodefacts.py: the nodes by list + watch (not a kopf index): events applied, 410 -> list again, a label
change updates the facts, a deleted node disappears, rounds wait for the first list; kube.py's watch lines."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fakekube import END, GONE, FakeKube

from kascade_operator import nodefacts
from kascade_operator.engine_client import EngineClient
from kascade_operator.kube import Gone, _watch_event
from kascade_operator.metrics import Scraper
from kascade_operator.nodefacts import NodeFacts
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings

LEAF, GPU = "kascade.io/leaf", "nvidia.com/gpu"


def node(name: str, leaf: str, gpus: int = 8, rv: int = 1, ready: str = "True") -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(rv), "labels": {LEAF: leaf}},
            "status": {"allocatable": {GPU: str(gpus)}, "capacity": {GPU: str(gpus)},
                       "conditions": [{"type": "Ready", "status": ready}]}}


async def until(pred: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


@contextlib.asynccontextmanager
async def running(kube: FakeKube) -> AsyncIterator[NodeFacts]:
    facts = NodeFacts(LEAF, GPU)
    task = asyncio.create_task(facts.run(kube))
    try:
        await asyncio.wait_for(facts.ready.wait(), 5)
        yield facts
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_watch_events_change_the_facts_and_a_heartbeat_changes_nothing() -> None:
    kube = FakeKube()
    kube.nodes = [node("a", "l0"), node("b", "l0")]
    async with running(kube) as facts:
        leaf0, gpus0 = facts.facts()
        assert leaf0 == {"a": "l0", "b": "l0"} and gpus0 == 8
        assert kube.node_watches == [facts.resource_version]  # watched from the list's version
        kube.node_events.put_nowait(("MODIFIED", node("a", "l0", rv=50, ready="False")))  # status only
        kube.node_events.put_nowait(("ADDED", node("c", "l1", gpus=16, rv=51)))
        await until(lambda: facts.resource_version == "51", "the events applied")
        leaf1, gpus1 = facts.facts()
        assert leaf1 == {"a": "l0", "b": "l0", "c": "l1"} and gpus1 == 16
        kube.node_events.put_nowait(("MODIFIED", node("c", "l1", gpus=16, rv=52, ready="False")))
        kube.node_events.put_nowait(("BOOKMARK", {"metadata": {"resourceVersion": "60"}}))
        await until(lambda: facts.resource_version == "60", "the bookmark")
        assert facts.facts()[0] is leaf1  # a heartbeat keeps the leaf dict: the pool snapshot stays valid
        assert [n["metadata"]["name"] for n in facts.node_list()] == ["a", "b", "c"]
        assert set(facts.node_list()[2]) == {"metadata", "status"}  # slim: no conditions kept
        assert set(facts.node_list()[2]["status"]) == {"allocatable", "capacity"}


async def test_a_label_change_moves_the_node_and_a_deleted_node_disappears() -> None:
    kube = FakeKube()
    kube.nodes = [node("a", "l0"), node("b", "l0", gpus=16)]
    async with running(kube) as facts:
        leaf0 = facts.facts()[0]
        kube.node_events.put_nowait(("MODIFIED", node("a", "l7", rv=70)))
        await until(lambda: facts.resource_version == "70", "the label change")
        leaf1 = facts.facts()[0]
        assert leaf1 == {"a": "l7", "b": "l0"} and leaf1 is not leaf0
        kube.node_events.put_nowait(("DELETED", node("b", "l0", gpus=16, rv=71)))
        await until(lambda: facts.resource_version == "71", "the delete")
        assert facts.facts() == ({"a": "l7"}, 8)  # the largest node went with it
        kube.node_events.put_nowait(("DELETED", node("zz", "l0", rv=72)))  # unknown: nothing changes
        await until(lambda: facts.resource_version == "72", "the second delete")
        assert facts.facts()[0] == {"a": "l7"}


async def test_410_gone_lists_again_and_drops_nodes_deleted_meanwhile() -> None:
    kube = FakeKube()
    kube.nodes = [node("a", "l0"), node("b", "l1")]
    async with running(kube) as facts:
        first_rv = facts.resource_version
        kube.nodes = [node("b", "l2"), node("d", "l3")]  # changed while the watch was away (no events seen)
        kube.node_events.put_nowait(GONE)
        await until(lambda: kube.node_lists == 2 and len(kube.node_watches) == 2, "the re-list and a new watch")
        assert facts.lists == 2
        assert facts.facts()[0] == {"b": "l2", "d": "l3"}
        assert kube.node_watches == [first_rv, facts.resource_version] and facts.resource_version != first_rv


async def test_a_watch_the_server_ends_resumes_from_the_last_version_without_a_list() -> None:
    kube = FakeKube()
    kube.nodes = [node("a", "l0")]
    async with running(kube) as facts:
        kube.node_events.put_nowait(("MODIFIED", node("a", "l0", rv=90)))
        kube.node_events.put_nowait(END)
        await until(lambda: len(kube.node_watches) == 2, "a second watch")
        assert kube.node_watches[1] == facts.resource_version == "90" and kube.node_lists == 1


class SlowList(FakeKube):
    """The first list waits for `release`: a round started meanwhile must wait, not see no nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]:
        await self.release.wait()
        return await super().list_nodes_page(limit, cont)


async def test_rounds_wait_for_the_first_list() -> None:
    kube = SlowList()
    kube.nodes = [node("a", "l0", gpus=4)]
    rt = Runtime(OperatorSettings(engine_token="t"), kube, EngineClient("t"), Scraper(), None,
                 OperatorMetrics())
    try:
        rt.watch_nodes()
        reading = asyncio.create_task(rt.node_facts())
        await asyncio.sleep(0.05)
        assert not reading.done()  # no answer from an empty cluster
        kube.release.set()
        assert await asyncio.wait_for(reading, 5) == ({"a": "l0"}, 4)
        assert [n["metadata"]["name"] for n in await rt.nodes()] == ["a"]
    finally:
        await rt.close()
    assert rt.node_task is not None and rt.node_task.done()


def test_watch_lines_an_expired_version_is_gone_and_other_errors_raise() -> None:
    assert _watch_event({"type": "ADDED", "object": {"metadata": {"name": "a"}}}, "1") == \
        ("ADDED", {"metadata": {"name": "a"}})
    with pytest.raises(Gone, match="too old"):
        _watch_event({"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}, "1")
    with pytest.raises(RuntimeError, match="500"):
        _watch_event({"type": "ERROR", "object": {"code": 500, "message": "boom"}}, "1")


class Body(dict[str, Any]):
    """A node body a weak reference can follow (a plain dict cannot)."""


class Pages(FakeKube):
    """Pages of full node bodies (with managedFields, as the API server sends them); when asked for the next
    page, records how many bodies of the pages handed out before are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[weakref.ref[Body]] = []
        self.alive_when_asked: list[int] = []

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]:
        gc.collect()
        self.alive_when_asked.append(sum(r() is not None for r in self.handed))
        items, rv, nxt = await super().list_nodes_page(limit, cont)
        bodies = [Body(n, metadata={**n["metadata"], "managedFields": [{"manager": "kwok", "fieldsV1": {}}]})
                  for n in items]
        self.handed += [weakref.ref(b) for b in bodies]
        return list(bodies), rv, nxt


async def test_the_list_is_read_in_pages_and_only_slim_nodes_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10,000 nodes one unpaged list held every full body at once (hundreds of MB of dicts, kept as RSS):
    a page's full bodies must be gone before the next page is read, and none is kept after the list."""
    monkeypatch.setattr(nodefacts, "LIST_PAGE", 3)
    kube = Pages()
    kube.nodes = [node(f"n{i}", f"l{i % 2}") for i in range(8)]
    async with running(kube) as facts:
        await until(lambda: facts.ready.is_set(), "the first list")
        gc.collect()
        assert kube.alive_when_asked == [0, 0, 0]  # three pages (3 + 3 + 2), each asked with none alive
        assert not any(r() is not None for r in kube.handed)
        assert len(facts.nodes) == 8 and facts.resource_version
        assert all("managedFields" not in n["metadata"] and "conditions" not in n["status"]
                   for n in facts.nodes.values())
        assert facts.facts() == ({f"n{i}": f"l{i % 2}" for i in range(8)}, 8)
