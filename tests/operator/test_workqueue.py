"""The event-driven rounds' parts: the work queue (de-duplicated, one round per key at a time, backoff) and the
shared metric sweep's view (a round reads it; a sweep reports only the groups whose loads changed)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Hashable
from dataclasses import replace

import pytest
from enginestub import EngineStub

from kascade_operator.metrics import Scraper
from kascade_operator.metricsview import MetricsView, group_of, targets
from kascade_operator.pool import PodView
from kascade_operator.workqueue import WorkQueue


async def _until(cond: object, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_a_key_added_many_times_before_its_round_gets_one_round() -> None:
    seen: list[Hashable] = []

    async def process(key: Hashable) -> None:
        seen.append(key)

    q = WorkQueue(process, workers=2)
    for _ in range(5):
        q.add("a", 0.05)
    q.add("b", 0.05)
    q.start()
    await _until(lambda: len(seen) >= 2)
    await asyncio.sleep(0.1)
    await q.stop()
    assert sorted(map(str, seen)) == ["a", "b"]


async def test_an_earlier_add_wins_and_a_later_one_does_not_postpone() -> None:
    q = WorkQueue(lambda k: asyncio.sleep(0), workers=1)
    q.add("a", 10.0)
    q.add("a", 0.5)
    q.add("a", 20.0)
    due = q.due_in("a")
    assert due is not None and 0.3 < due <= 0.5


async def test_a_key_added_while_its_round_runs_runs_again_after_never_at_once() -> None:
    running, rounds, overlap = 0, 0, False
    release = asyncio.Event()

    async def process(key: Hashable) -> None:
        nonlocal running, rounds, overlap
        running += 1
        overlap = overlap or running > 1
        rounds += 1
        if rounds == 1:
            await release.wait()
        running -= 1

    q = WorkQueue(process, workers=4)
    q.start()
    q.add("a")
    await _until(lambda: rounds == 1)
    q.add("a")  # the inputs changed while the round ran: it must see them in a second round
    await asyncio.sleep(0.05)
    assert rounds == 1  # not started beside the running one
    release.set()
    await _until(lambda: rounds == 2)
    await q.stop()
    assert not overlap


async def test_a_busy_key_is_not_queued_behind_idle_ones() -> None:
    seen: list[Hashable] = []

    async def process(key: Hashable) -> None:
        seen.append(key)

    q = WorkQueue(process, workers=1)
    for i in range(100):
        q.add(f"idle{i}", 30.0)  # resync far away
    q.start()
    q.add("burst")
    await _until(lambda: seen == ["burst"], 1.0)
    await q.stop()


async def test_an_input_change_goes_ahead_of_every_due_resync() -> None:
    seen: list[Hashable] = []
    late: dict[Hashable, tuple[float, bool]] = {}

    async def process(key: Hashable) -> None:
        seen.append(key)

    q = WorkQueue(process, workers=1, on_take=lambda k, s, u: late.__setitem__(k, (s, u)))
    for i in range(50):
        q.add(f"idle{i}", 0.0)  # resyncs due now, earlier than the change below
    await asyncio.sleep(0.02)
    q.add("burst", urgent=True)
    assert q.urgent("burst") and not q.urgent("idle0")
    assert q.overdue(0.01) == 50  # the resyncs are more than 10 ms past due; the change is not yet
    q.start()
    await _until(lambda: len(seen) == 51, 2.0)
    assert seen[0] == "burst"  # taken first although 50 keys were due before it
    assert late["burst"][1] and not late["idle0"][1]
    assert late["idle0"][0] >= 0.02 > late["burst"][0] >= 0.0  # lateness = start - due
    assert q.overdue(0.0) == 0
    await q.stop()


async def test_a_queued_resync_made_urgent_keeps_its_earlier_due_time() -> None:
    q = WorkQueue(lambda key: asyncio.sleep(0), workers=1)
    q.add("a", 5.0)
    q.add("a", 10.0, urgent=True)  # a later change: urgent now, still due in ~5 s, not 10
    assert q.urgent("a") and 4.0 < (q.due_in("a") or 0) <= 5.0
    q.add("a", 1.0)  # an earlier non-urgent add moves the time and keeps it urgent
    assert q.urgent("a") and (q.due_in("a") or 9) <= 1.0
    assert len(q) == 1


async def test_a_failing_round_is_retried_with_growing_backoff() -> None:
    times: list[float] = []
    loop = asyncio.get_running_loop()

    async def process(key: Hashable) -> None:
        times.append(loop.time())
        if len(times) < 3:
            raise RuntimeError("apiserver said no")

    q = WorkQueue(process, workers=1, base_backoff_s=0.05)
    q.start()
    q.add("a")
    await _until(lambda: len(times) == 3)
    await q.stop()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= 0.045 and gaps[1] >= 0.095, gaps  # 0.05 then 0.1


def test_bad_worker_count_is_refused() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        WorkQueue(lambda k: asyncio.sleep(0), workers=0)


def _pod(name: str, svc: str | None, endpoint: str, ready: bool = True, draining: bool = False) -> PodView:
    return PodView(pod_name=name, node="n0", resource_version="1", pool=True, model_service=svc,
                   role="colocated" if svc else None, ready=ready, draining=draining, endpoint=endpoint,
                   instance=name)


def test_only_bound_ready_undrained_engines_are_swept_grouped_as_rounds_read_them() -> None:
    pods = [_pod("a", "svc", "h:1"), _pod("b", "other/svc", "h:2"), _pod("c", None, "h:3"),
            _pod("d", "svc", "h:4", ready=False), _pod("e", "svc", "h:5", draining=True)]
    assert targets({"pool": pods}) == {("pool", "svc", "colocated"): {"a": "h:1"},
                                       ("other", "svc", "colocated"): {"b": "h:2"}}
    assert group_of(pods[2], "pool") is None


async def test_a_sweep_reports_changed_groups_and_rounds_read_its_view() -> None:
    stubs = [EngineStub(f"e{i}", "tiny", "t") for i in range(2)]
    view = MetricsView(Scraper(timeout_s=10.0, window_s=0.0), max_age_s=10.0, concurrency=1)  # loaded CI: no timeouts
    try:
        groups = {("ns", f"s{i}", "colocated"): {s.instance: s.endpoint} for i, s in enumerate(stubs)}
        assert await view.sweep(groups) == set(groups)  # first readings: every group is new
        await asyncio.sleep(0.05)
        assert await view.sweep(groups) == set()  # idle engines: nothing changed, no round
        stubs[1].tokens_per_s = 3000.0
        await asyncio.sleep(0.1)
        assert await view.sweep(groups) == {("ns", "s1", "colocated")}
        before = view.reading(("ns", "s1", "colocated"))
        loads = await view.collect(groups[("ns", "s1", "colocated")], ("ns", "s1", "colocated"))
        assert loads[0].input_tokens_per_s > 0
        assert view.reading(("ns", "s1", "colocated")) is before  # read from the view, not scraped again
        # a round over an instance the view has not seen scrapes it now
        extra = {**groups[("ns", "s1", "colocated")], stubs[0].instance: stubs[0].endpoint}
        assert len(await view.collect(extra, ("ns", "s1", "colocated"))) == 2
        # each change is handed on the moment its own scrape is in, not after the whole sweep
        stubs[0].tokens_per_s = 4000.0
        handed: list[tuple[str, str, str]] = []
        await asyncio.sleep(0.1)
        assert await view.sweep(groups, handed.append) == {("ns", "s0", "colocated"), ("ns", "s1", "colocated")}
        assert sorted(handed) == sorted(groups)
        # a group that stopped serving is forgotten
        await view.sweep({("ns", "s0", "colocated"): groups[("ns", "s0", "colocated")]})
        assert view.reading(("ns", "s1", "colocated")) is None
    finally:
        for s in stubs:
            s.close()


async def test_a_change_is_handed_on_before_a_slow_engine_of_the_same_sweep_answers() -> None:
    gate = asyncio.Event()

    class Scraper:  # the slow group's engine answers only when the test says so
        def __init__(self) -> None:
            self.rates: dict[Hashable, object] = {}

        async def collect(self, endpoints: dict[str, str], group: Hashable = None) -> list[object]:
            if group == ("ns", "slow", "colocated"):
                await gate.wait()
            return []

    view = MetricsView(Scraper(), max_age_s=10.0, concurrency=4)  # type: ignore[arg-type]
    handed: list[tuple[str, str, str]] = []
    groups = {("ns", "slow", "colocated"): {"e0": "x:1"}, ("ns", "fast", "colocated"): {"e1": "x:2"}}
    sweep = asyncio.create_task(view.sweep(groups, handed.append))
    await _until(lambda: handed == [("ns", "fast", "colocated")], 2.0)
    assert not sweep.done()  # the fast group's round was queued while the sweep still waits
    gate.set()
    assert await sweep == set(groups)
    assert handed == [("ns", "fast", "colocated"), ("ns", "slow", "colocated")]


async def test_resyncs_take_at_most_their_share_of_workers_and_a_change_gets_a_free_one() -> None:
    running: set[Hashable] = set()
    most = 0
    release = asyncio.Event()

    async def process(key: Hashable) -> None:
        nonlocal most
        running.add(key)
        most = max(most, len({k for k in running if str(k).startswith("idle")}))
        if str(key).startswith("idle"):
            await release.wait()
        running.discard(key)

    q = WorkQueue(process, workers=4, background=2)
    for i in range(10):
        q.add(f"idle{i}")
    q.start()
    await _until(lambda: len(running) == 2, 1.0)
    await asyncio.sleep(0.05)
    assert most == 2 and len(q) == 8  # two resyncs run, the other eight wait although two workers are free
    q.add("burst", urgent=True)
    await _until(lambda: len(q) == 8 and "burst" not in running, 1.0)  # taken by a free worker and done
    release.set()
    await _until(lambda: len(q) == 0 and not running, 2.0)
    assert most == 2
    await q.stop()
    with pytest.raises(ValueError, match="background"):
        WorkQueue(process, workers=4, background=0)


async def test_a_key_whose_round_runs_outside_the_queue_is_left_to_it_and_the_others_go_on() -> None:
    """A kopf change handler's round holds the service's lock: a worker that took that key waited on it for the
    handler's whole round (a creating round's instruct) and, all workers so blocked, no other round started."""
    seen: list[Hashable] = []
    handler_done = asyncio.Event()

    async def process(key: Hashable) -> None:
        seen.append(key)
        if key == "busy":  # as queued_round: the service's lock, held by the handler until its round ends
            await handler_done.wait()

    q = WorkQueue(process, workers=1)
    q.start()
    with q.held("busy"):
        q.add("busy")  # its pod changed while the handler's round runs
        q.add("other", 0.01)
        await _until(lambda: "other" in seen)  # the one worker was waiting on "busy" (it never came)
        assert seen == ["other"]
    handler_done.set()
    await _until(lambda: "busy" in seen)  # taken once the handler's round is over
    await q.stop()
    assert seen == ["other", "busy"]


async def test_held_twice_the_key_waits_for_both() -> None:
    seen: list[Hashable] = []

    async def process(key: Hashable) -> None:
        seen.append(key)

    q = WorkQueue(process, workers=1)
    q.start()
    with q.held("a"):
        with q.held("a"):
            q.add("a")
        await asyncio.sleep(0.05)
        assert seen == []
    await _until(lambda: seen == ["a"])
    await q.stop()


async def test_a_reading_within_a_period_plus_the_last_sweeps_length_is_not_scraped_again() -> None:
    class Counting:  # every scrape counted; its engine answers at once
        def __init__(self) -> None:
            self.rates: dict[Hashable, object] = {}
            self.scrapes = 0

        async def collect(self, endpoints: dict[str, str], group: Hashable = None) -> list[object]:
            self.scrapes += 1
            return []

    scraper = Counting()
    view = MetricsView(scraper, max_age_s=1.0)  # type: ignore[arg-type]
    g, eps = ("ns", "s", "colocated"), {"e0": "x:1"}
    await view.sweep({g: eps})
    r = view.reading(g)
    assert r is not None and scraper.scrapes == 1
    view.last_sweep_s = 3.0  # sweeps take 3 s now (1,000 engines, or slow ones)
    assert view.fresh(r, r.taken_s + 3.9) and not view.fresh(r, r.taken_s + 4.1)
    view._readings[g] = replace(r, taken_s=r.taken_s - 2.5)  # older than the period, within period + sweep
    await view.collect(eps, g)
    assert scraper.scrapes == 1  # the view's reading: no scrape of its own (was: one per round)
    view._readings[g] = replace(r, taken_s=r.taken_s - 4.5)  # the sweep has fallen behind even that
    await view.collect(eps, g)
    assert scraper.scrapes == 2


def test_overdue_is_counted_whole_while_another_thread_changes_the_queue() -> None:
    """`overdue` is a gauge's function: the metrics server's thread calls it while the loop adds and forgets keys.
    Counted over the dict itself it raised "dictionary changed size during iteration" (a lost scrape)."""
    q = WorkQueue(lambda k: asyncio.sleep(0), workers=1)
    for i in range(500):
        q.add(f"old{i}")  # due now
    done = threading.Event()

    def loop_side() -> None:
        for k in itertools.count():
            if done.is_set():
                return
            q.add(f"k{k}", delay=60.0)
            q.forget(f"k{k - 200}")

    t = threading.Thread(target=loop_side)
    t.start()
    try:
        # a negative tolerance counts the keys due within 30 s from now: the 500, not the thread's (due in 60 s)
        counts = [q.overdue(-30.0) for _ in range(3000)]
    finally:
        done.set()
        t.join()
    assert set(counts) == {500}
