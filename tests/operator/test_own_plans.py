"""Read your own writes for ScalePlans (runtime.py `created_plan`): a plan this process created is in
`Runtime.scaleplans` before the watch shows it, so the service's next round does not plan the same scale-up again.

Seen at 2,000 nodes / 200 services under load (issue 33): the watch lagged a created plan by tens of seconds, its
instruct took ~50 s, the targets' claims (30 s) had expired, and the next round, seeing neither the plan nor its
target bound, made a second plan for the same target."""

from __future__ import annotations

from typing import Any

import pytest
from fakekube import FakeKube

from kascade_operator import runtime as R
from kascade_operator.engine_client import EngineClient
from kascade_operator.metrics import Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings


def _plan(name: str, phase: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"}, **({"status": {"phase": phase}} if phase else {})}


@pytest.fixture
def rt() -> Runtime:
    r = Runtime(OperatorSettings(engine_token="t"), FakeKube(), EngineClient("t"), Scraper(), None, OperatorMetrics())
    r.plan_index = {"ns": [], "other": []}
    return r


async def test_a_created_plan_stands_in_until_the_watch_shows_it(rt: Runtime) -> None:
    rt.created_plan("ns", _plan("svc-a"))
    assert [p["metadata"]["name"] for p in await rt.scaleplans("ns")] == ["svc-a"]  # the watch has not shown it
    assert await rt.scaleplans("other") == []  # another namespace's rounds do not see it
    assert rt.plan_index is not None
    rt.plan_index["ns"].append(_plan("svc-a", "Running"))  # the watch caught up: its copy, once
    assert await rt.scaleplans("ns") == [_plan("svc-a", "Running")]
    rt.plan_index["ns"].clear()  # and once seen, a plan the watch no longer holds (deleted) does not come back
    assert await rt.scaleplans("ns") == []


async def test_a_created_plan_the_watch_never_shows_stops_standing_in(rt: Runtime, monkeypatch: Any) -> None:
    rt.created_plan("ns", _plan("svc-b"))
    assert len(await rt.scaleplans("ns")) == 1
    monkeypatch.setattr(R, "OWN_PLAN_S", -1.0)  # its time is up (60 s in the operator)
    assert await rt.scaleplans("ns") == []  # deleted before the watch showed it: not a phantom forever
