"""One fleet for two models on the real control plane with REAL engines (issue 35): four warm-pool engine
processes started for model B, two ModelServices sharing them, the operator as a real process, requests
through the real router.

Shown here: A's first copy binds an engine started for B (the engine switches model at bind); B holds three
idle replicas; a burst on A (priority 10) finds the pool empty, and the operator's arbitration preempts B's idle
replicas (B priority 0) down to B's min, drained and released; A's new replicas bind those released engines of
B, switch them to A and load A's weights by plan from A's serving replica; B's status says why it got less and
Events name the preemptions; no request of either model fails. Then A's burst ends, A returns to its min and
B's load returns: B scales back on the engines A released. The time from the decision (the ScalePlan that
binds a released engine of B for A) to that replica serving A is measured and printed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.fleetcase import TOKEN, FleetCase, msvc, switch_seconds
from kascade_devcluster.loadgen import LoadGen
from kascade_devcluster.objectwatch import ObjectWatch
from kascade_devcluster.waiting import wait_for
from kascade_engine.weights.checkpoint import tiny_llama

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PROMPT = list(range(3, 35))


def _none_failed(gens: dict[str, LoadGen]) -> None:
    """Each model's (stopped) load had answers and none of its requests failed."""
    for name, g in gens.items():
        s = g.summary()
        assert s["failed"] == 0 and s["ok"] > 0, (name, s, g.failures()[:5])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet")
    return {"model-a": tiny_llama(root / "model-a", layers=6, hidden=128, vocab=1024, seed=1),
            "model-b": tiny_llama(root / "model-b", layers=4, hidden=96, vocab=1024, seed=2),
            "model-c": tiny_llama(root / "model-c", layers=4, hidden=128, vocab=1024, seed=3)}


@pytest.fixture
def case(control_plane: ControlPlane, crds: list[str], namespace: str, ckpts: dict[str, Path],
         tmp_path: Path) -> Iterator[FleetCase]:
    """The fleet's processes for one test (the test starts them on its nodes: `case.start`)."""
    c = FleetCase(control_plane, namespace, ckpts, tmp_path)
    try:
        yield c
    finally:
        print(c.stop())


def test_a_burst_on_one_model_takes_the_idle_engines_of_another_and_gives_them_back(
        case: FleetCase, kwok_nodes: Callable[..., list[str]], ckpts: dict[str, Path]) -> None:
    pool, router = case.start(kwok_nodes(4, leaves=1), "model-b")
    serving = case.serving
    case.apply(msvc("model-a", ckpts["model-a"], 1, 3, priority=10, delay_s=1.0))
    (a0,) = wait_for(lambda: serving("model-a"), 180, "A's first copy (an engine started for B switched)")
    case.apply(msvc("model-b", ckpts["model-b"], 1, 3, priority=0, delay_s=600.0))
    wait_for(lambda: serving("model-b"), 180, "B's first copy")
    gen_a = LoadGen(router.url, "model-a", PROMPT, max_tokens=8).start()
    gen_b = LoadGen(router.url, "model-b", PROMPT, max_tokens=8).start()
    b_watch: ObjectWatch | None = None
    try:
        # B's burst takes the free engines, then B idles on them (a long scale-down delay keeps them)
        gen_b.set_load(workers=6)
        wait_for(lambda: len(serving("model-b")) == 3, 180, "B at 3 replicas")
        gen_b.set_load(workers=1, think_s=1.0)  # B: a trickle, far below its lower bound
        b_engines = set(serving("model-b"))
        time.sleep(case.hysteresis_s + 1)  # B's replicas leave the hysteresis
        # B's status.arbitration lasts from the round that drains its preempted replicas until its next rounds
        # ask only for what it holds (a second or so): watched, not polled
        b_watch = ObjectWatch(case.cp, case.ns, "msvc", "model-b")
        gen_a.set_load(workers=6)  # A: the burst
        t_burst = time.monotonic()
        wait_for(lambda: len(serving("model-a")) == 3, 180, "A at 3 replicas on B's engines", poll=0.05)
        t_up = time.monotonic()
        seen: list[dict[str, Any]] = wait_for(lambda: b_watch.values("status", "arbitration"), 30,
                                              "B's status.arbitration while preempted (watched)")
        a_now = set(serving("model-a"))
        assert a0 in a_now and len(a_now & b_engines) == 2  # two engines of B changed model
        for name in a_now & b_engines:  # the engines say so themselves
            st = httpx.get(f"{pool.engines[name].url}/kascade/v1/status", timeout=5,
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert (st["model"], st["modelService"], st["phase"]) == ("model-a", "model-a", "serving"), st
        assert serving("model-b") and len(serving("model-b")) == 1  # B at its min
        events = case.events("model-b")
        assert sum(1 for e in events if e["reason"] == "Preempted") >= 2, [e["reason"] for e in events]
        assert any("priority 10 above 0" in e["message"] for e in events if e["reason"] == "Preempted")
        # the plans that bound B's released engines for A: from A's serving replicas (gpu sources), timed
        plans = case.plans_for("model-a", b_engines)
        assert plans and all(p["status"]["phase"] == "Succeeded" for p in plans), plans
        srcs = [(s["kind"], s.get("pod")) for p in plans for s in p["spec"]["sources"]]
        assert srcs and all(kind == "gpu" and pod in a_now for kind, pod in srcs), srcs
        switch_s, durations = zip(*switch_seconds(plans), strict=True)
        during = gen_a.summary(since=t_burst)
        assert during["failed"] == 0 and during["ok"] > 20, during

        # A's burst ends (A back to its min after 1 s), B's load returns: B grows on the engines A released
        gen_a.set_load(workers=0)
        gen_b.set_load(workers=6)
        t_b = time.monotonic()
        wait_for(lambda: len(serving("model-b")) == 3, 180, "B back at 3 replicas")
        t_back = time.monotonic()
        assert len(serving("model-a")) == 1
        wait_for(lambda: not case.arbitration("model-b"), 30,
                 "B's arbitration status cleared")
    finally:
        gen_a.stop()
        gen_b.stop()
        if b_watch is not None:
            b_watch.stop()
    _none_failed({"A": gen_a, "B": gen_b})
    print(f"\nB's status.arbitration while preempted: {seen[:1]}\n"
          f"A 1 -> 3 on B's engines: {t_up - t_burst:.1f} s after the burst; decision (ScalePlan created) -> "
          f"serving A on a released engine of B: {', '.join(f'{x:.2f}' for x in switch_s)} s "
          f"(plan durationSeconds {', '.join(f'{x:.2f}' for x in durations)}); B 1 -> 3 again: {t_back - t_b:.1f} s"
          f"\nrequests A {gen_a.summary()}\nrequests B {gen_b.summary()}")
    assert seen and seen[0]["rankedAbove"] == ["model-a"] and seen[0]["preempted"], seen


def test_three_models_on_six_engines_a_burst_takes_the_idle_model_down_to_its_min_and_back(
        case: FleetCase, kwok_nodes: Callable[..., list[str]], ckpts: dict[str, Path]) -> None:
    """Three models share six engines started for C: C (priority 5) serves a steady trickle at its min 1, A
    (priority 10) and B (priority 0) start at their min 1; B's burst takes the three free engines, then B idles
    on them. A's burst finds no free engine: the arbitration preempts B's idle replicas down to B's min (C's one
    replica, at its min, is never touched), A's new replicas bind B's released engines, switch them to A and
    load from A's serving replica (or a host copy of A). Then A's burst ends and B's load returns: B grows back
    to 4 on the engines A released. No request of any model fails."""
    pool, router = case.start(kwok_nodes(6, leaves=1), "model-c")
    serving = case.serving
    case.apply(msvc("model-c", ckpts["model-c"], 1, 2, priority=5, delay_s=600.0))
    (c0,) = wait_for(lambda: serving("model-c"), 180, "C's first copy")
    case.apply(msvc("model-a", ckpts["model-a"], 1, 4, priority=10, delay_s=1.0))
    (a0,) = wait_for(lambda: serving("model-a"), 180, "A's first copy (an engine started for C switched)")
    case.apply(msvc("model-b", ckpts["model-b"], 1, 4, priority=0, delay_s=600.0))
    wait_for(lambda: serving("model-b"), 180, "B's first copy")
    gens = {m: LoadGen(router.url, m, PROMPT, max_tokens=8).start() for m in ("model-a", "model-b", "model-c")}
    gen_a, gen_b, gen_c = gens["model-a"], gens["model-b"], gens["model-c"]
    b_watch: ObjectWatch | None = None
    try:
        gen_c.set_load(workers=1, think_s=1.5)  # C: steady, between its bounds (it holds its one replica)
        gen_b.set_load(workers=6)  # B's burst takes the three free engines, then B idles on them
        wait_for(lambda: len(serving("model-b")) == 4, 240, "B at 4 replicas (the pool empty)")
        gen_b.set_load(workers=1, think_s=2.0)  # B: a trickle, far below its lower bound (delay 600 s holds it)
        b_engines = set(serving("model-b"))
        time.sleep(case.hysteresis_s + 1)  # B's replicas leave the hysteresis
        b_watch = ObjectWatch(case.cp, case.ns, "msvc", "model-b")  # B's status.arbitration: watched (test above)
        gen_a.set_load(workers=8)  # A: the burst
        t_burst = time.monotonic()
        planned: dict[str, float] = {}  # engine of B -> when the test first saw a plan of A binding it
        served: dict[str, float] = {}  # engine of B -> when the test first saw it serving A

        def a_at_4() -> bool:
            now = time.monotonic()
            for p in case.plans_for("model-a", b_engines):
                for t in p["spec"]["targets"]:
                    planned.setdefault(t["pod"], now)
            a = serving("model-a")
            for name in set(a) & b_engines:
                served.setdefault(name, time.monotonic())
            return len(a) == 4

        wait_for(a_at_4, 240, "A at 4 replicas on B's engines", poll=0.05)
        t_up = time.monotonic()
        seen: list[dict[str, Any]] = wait_for(lambda: b_watch.values("status", "arbitration"), 30,
                                              "B's status.arbitration while preempted (watched)")
        a_now = set(serving("model-a"))
        assert a0 in a_now and len(a_now & b_engines) == 3, (a_now, b_engines)  # three engines of B changed model
        for name in a_now & b_engines:  # the engines say so themselves
            st = httpx.get(f"{pool.engines[name].url}/kascade/v1/status", timeout=10,
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert (st["model"], st["modelService"], st["phase"]) == ("model-a", "model-a", "serving"), st
            # and so do its Prometheus series: started for C, switched to B, then to A
            names = set(re.findall(r'model_name="([^"]+)"', httpx.get(f"{pool.engines[name].url}/metrics",
                                                                       timeout=10).text))
            assert names == {"model-a"}, (name, names)
        assert len(serving("model-b")) == 1  # B at its min
        assert serving("model-c") == [c0]  # C at its min: never preempted
        ev_b, ev_c = case.events("model-b"), case.events("model-c")
        assert sum(1 for e in ev_b if e["reason"] == "Preempted") >= 3, [e["reason"] for e in ev_b]
        assert not [e for e in ev_c if e["reason"] == "Preempted"], ev_c
        plans = case.plans_for("model-a", b_engines)
        assert plans and all(p["status"]["phase"] == "Succeeded" for p in plans), plans
        srcs = [(s["kind"], s.get("pod"), bool(s.get("hostCopy"))) for p in plans for s in p["spec"]["sources"]]
        # from A's serving replicas (gpu) or a host copy of A: never from the model's files
        assert srcs and all((kind == "gpu" and pod in a_now) or host for kind, pod, host in srcs), srcs
        timed = switch_seconds(plans)
        # decision -> serving per switched engine as this test saw it (polled, ~0.1-0.5 s per poll under load)
        polled = {n: served[n] - planned[n] for n in sorted(served) if n in planned}
        during = gen_a.summary(since=t_burst)
        assert during["failed"] == 0 and during["ok"] > 20, during

        gen_a.set_load(workers=0)  # A's burst ends (back to its min after 1 s); B's load returns
        gen_b.set_load(workers=6)
        t_b = time.monotonic()
        wait_for(lambda: len(serving("model-b")) == 4, 240, "B back at 4 replicas")
        t_back = time.monotonic()
        assert len(serving("model-a")) == 1 and serving("model-c") == [c0]
        wait_for(lambda: not case.arbitration("model-b"), 60, "B's arbitration status cleared")
    finally:
        for g in gens.values():
            g.stop()
        if b_watch is not None:
            b_watch.stop()
    _none_failed(gens)
    print(f"\nthree models, six engines: B's status.arbitration while preempted: {seen[:1]}\n"
          f"A 1 -> 4 on B's engines: {t_up - t_burst:.1f} s after the burst; decision (ScalePlan created) -> "
          f"serving A on a released engine of B: {', '.join(f'{a:.2f}' for a, _ in timed)} s "
          f"(plan durationSeconds {', '.join(f'{d:.2f}' for _, d in timed)}); polled plan seen -> serving per "
          f"engine: {', '.join(f'{n} {x:.2f}' for n, x in polled.items())} s (first plan seen "
          f"{min(planned.values(), default=t_burst) - t_burst:.1f} s after the burst); "
          f"B 1 -> 4 again: {t_back - t_b:.1f} s\n"
          + "\n".join(f"requests {m} {g.summary()}" for m, g in gens.items()))
    assert seen and seen[0]["rankedAbove"] == ["model-a"] and seen[0]["preempted"], seen
