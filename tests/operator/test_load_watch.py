"""Load watches (kascade_operator.loadwatch) against the engine stand-in's /metrics over real HTTP: a crossing
reaches `on_left` within a few ticks although no sweep runs, an idle engine's watch only returns when its wait
runs out, a watch of an engine that stops serving is ended."""

from __future__ import annotations

import asyncio
import time

import pytest
from enginestub import EngineStub

from kascade_operator.loadwatch import LoadWatchers
from kascade_operator.metrics import Scraper
from kascade_operator.metricsview import Group, MetricsView

G: Group = ("default", "svc", "colocated")


@pytest.fixture
def stub() -> EngineStub:
    s = EngineStub("e0", "m", "tok")
    yield s
    s.close()


async def test_a_crossing_is_answered_within_ticks_without_a_sweep(stub: EngineStub) -> None:
    scraper = Scraper(2.0, window_s=1.0)
    view = MetricsView(scraper, max_age_s=60.0)
    left: list[float] = []
    changed: list[bool] = []

    def on_left(g: Group, instance: str, text: str) -> bool:
        assert (g, instance) == (G, "e0")
        left.append(time.monotonic())
        changed.append(view.answered(g, instance, text))
        return changed[-1]

    await view.sweep({G: {"e0": stub.endpoint}})  # the one sweep: a reading to put the band around
    w = LoadWatchers(scraper, view, wait_s=30.0, window_s=1.0, interval_s=60.0, on_left=on_left)
    w.sync({G: {"e0": stub.endpoint}})
    await asyncio.sleep(0.5)
    assert left == []  # idle: held
    t0 = time.monotonic()
    stub.tokens_per_s = 5000.0  # the engine's 1 s rate passes +100 tokens/s 20 ms later
    for _ in range(200):
        if left:
            break
        await asyncio.sleep(0.01)
    assert left, "the watch did not answer the crossing"
    assert left[0] - t0 < 0.5  # ticks of 20 ms, not the 60 s interval
    assert changed[0] and w.answered >= 1
    r = view.reading(G)
    assert r is not None and r.loads[0].input_tokens_per_s > 0  # from the watch's answer: no scrape since
    assert view.sweeps == 1
    w.sync({})  # the engine serves no group any more: its watch ends
    assert len(w) == 0
    await w.close()
    await scraper.aclose()


async def test_an_idle_engine_answers_when_the_wait_runs_out(stub: EngineStub) -> None:
    scraper = Scraper(2.0, window_s=1.0)
    view = MetricsView(scraper, max_age_s=60.0)
    await view.sweep({G: {"e0": stub.endpoint}})
    w = LoadWatchers(scraper, view, wait_s=0.3, window_s=1.0, interval_s=60.0, on_left=lambda g, i, t: True)
    w.sync({G: {"e0": stub.endpoint}})
    await asyncio.sleep(1.0)
    assert w.answered == 0 and stub.watches >= 2  # answered at the wait's end, re-armed, never "left"
    await w.close()
    await scraper.aclose()


async def test_a_bad_watch_query_is_refused_naming_the_field(stub: EngineStub) -> None:
    from kascade_operator.scrapeconn import ScrapeConns
    c = ScrapeConns(2.0)
    status, text = await c.get(stub.endpoint, "/metrics?wait=5&above=1&below=0&window=-1")
    assert status == 400 and "window:" in text
    await c.aclose()


async def test_an_answer_updates_its_engine_and_keeps_the_others_and_the_readings_age() -> None:
    a, b = EngineStub("a", "m", "tok"), EngineStub("b", "m", "tok")
    try:
        scraper = Scraper(2.0, window_s=1.0)
        view = MetricsView(scraper, max_age_s=60.0)
        eps = {"a": a.endpoint, "b": b.endpoint}
        await view.sweep({G: eps})
        before = view.reading(G)
        assert before is not None
        b.tokens_per_s = 1e6
        await asyncio.sleep(0.1)
        assert not view.answered(G, "a", a.metrics_text())  # a is idle: nothing the rounds read moved
        assert not view.answered(G, "zz", b.metrics_text())  # not one of the group's engines: ignored
        assert view.answered(G, "b", b.metrics_text())
        r = view.reading(G)
        assert r is not None and r.taken_s == before.taken_s and r.endpoints == before.endpoints
        by = {x.instance: x.input_tokens_per_s for x in r.loads}
        assert by["a"] == 0.0 and by["b"] > 1000.0
        await scraper.aclose()
    finally:
        a.close()
        b.close()


async def test_an_engine_that_keeps_answering_is_re_armed_at_most_every_min_gap() -> None:
    """An engine and the operator that disagree on the rate (another window) would answer every watch at once:
    the rounds it wakes are capped at 1 / MIN_GAP_S a second; an answer without a change waits the interval."""
    from kascade_operator.loadwatch import MIN_GAP_S

    class AtOnce:
        calls = 0

        async def watch(self, endpoint: str, watch: object) -> str:
            AtOnce.calls += 1
            await asyncio.sleep(0)
            return ""

    for changed, most in ((True, 1.0 / MIN_GAP_S + 2), (False, 2)):
        AtOnce.calls = 0
        view = MetricsView(Scraper(1.0), max_age_s=60.0)
        def on_left(g: Group, i: str, t: str, c: bool = changed) -> bool:
            return c

        w = LoadWatchers(AtOnce(), view, wait_s=30.0, window_s=1.0, interval_s=5.0,  # type: ignore[arg-type]
                         on_left=on_left)
        w.sync({G: {"e0": "127.0.0.1:1"}})
        await asyncio.sleep(1.0)
        await w.close()
        assert 1 <= AtOnce.calls <= most, (changed, AtOnce.calls)
