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

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.loadgen import LoadGen
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.routerproc import RouterProcess
from kascade_devcluster.waiting import wait_for
from kascade_engine.weights.checkpoint import tiny_llama

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
TOKEN = "e2e-fleet-token"
PROMPT = list(range(3, 35))
HYSTERESIS_S = 3.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet")
    return {"model-a": tiny_llama(root / "model-a", layers=6, hidden=128, vocab=1024, seed=1),
            "model-b": tiny_llama(root / "model-b", layers=4, hidden=96, vocab=1024, seed=2)}


@pytest.fixture
def fleet(control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]],
          ckpts: dict[str, Path], tmp_path: Path) -> Iterator[tuple[EnginePool, RouterProcess]]:
    nodes = kwok_nodes(4, leaves=1)
    pool = EnginePool(control_plane, namespace, ckpts["model-b"], "model-b", TOKEN, tmp_path / "engines",
                      extra_args=("--kv-tokens", "4096"))
    op = OperatorProcess(control_plane, namespace, TOKEN, tmp_path / "operator.log",
                         env={"KASCADE_OPERATOR_ARBITRATION_HYSTERESIS_SECONDS": str(HYSTERESIS_S)})
    router = RouterProcess(control_plane, namespace, tmp_path / "router.log")
    try:
        pool.start(nodes)
        op.start()
        router.start()
        yield pool, router
    finally:
        router.stop()
        op.stop()
        print(op.tail())
        pool.stop()


def msvc(name: str, ckpt: Path, lo: int, priority: int, delay_s: float) -> dict[str, Any]:
    return {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": name},
            "spec": {"model": {"name": name, "source": {"path": str(ckpt)}}, "engine": {"image": "kascade:dev"},
                     "replicas": {"colocated": {"min": lo, "max": 3}},
                     "scaling": {"policy": "threshold", "intervalSeconds": 0.2, "scaleDownDelaySeconds": delay_s,
                                 "priority": priority,
                                 "threshold": {"metric": "tokensPerSecond", "upper": 60, "lower": 20}}}}


def get(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def serving(cp: ControlPlane, ns: str, svc: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in get(cp, ns, "pods", "-l", f"kascade.io/model-service={svc}")["items"]
                  if p["metadata"]["annotations"].get("kascade.io/loaded") == "true"
                  and "kascade.io/draining" not in p["metadata"]["annotations"])


def ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def test_a_burst_on_one_model_takes_the_idle_engines_of_another_and_gives_them_back(
        control_plane: ControlPlane, namespace: str, fleet: tuple[EnginePool, RouterProcess],
        ckpts: dict[str, Path]) -> None:
    cp, ns = control_plane, namespace
    pool, router = fleet
    apply = lambda doc: cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))  # noqa: E731
    apply(msvc("model-a", ckpts["model-a"], 1, priority=10, delay_s=1.0))
    (a0,) = wait_for(lambda: serving(cp, ns, "model-a"), 180, "A's first copy (an engine started for B switched)")
    apply(msvc("model-b", ckpts["model-b"], 1, priority=0, delay_s=600.0))
    wait_for(lambda: serving(cp, ns, "model-b"), 180, "B's first copy")
    gen_a = LoadGen(router.url, "model-a", PROMPT, max_tokens=8).start()
    gen_b = LoadGen(router.url, "model-b", PROMPT, max_tokens=8).start()
    try:
        # B's burst takes the free engines, then B idles on them (a long scale-down delay keeps them)
        gen_b.set_load(workers=6)
        wait_for(lambda: len(serving(cp, ns, "model-b")) == 3, 180, "B at 3 replicas")
        gen_b.set_load(workers=1, think_s=1.0)  # B: a trickle, far below its lower bound
        b_engines = set(serving(cp, ns, "model-b"))
        time.sleep(HYSTERESIS_S + 1)  # B's replicas leave the hysteresis
        gen_a.set_load(workers=6)  # A: the burst
        t_burst = time.monotonic()
        seen: list[dict[str, Any]] = []  # B's status.arbitration while A takes its engines

        def a_at_3() -> bool:
            arb = (get(cp, ns, "msvc", "model-b").get("status") or {}).get("arbitration")
            if arb:
                seen.append(arb)
            return len(serving(cp, ns, "model-a")) == 3

        wait_for(a_at_3, 180, "A at 3 replicas on B's engines", poll=0.05)
        t_up = time.monotonic()
        a_now = set(serving(cp, ns, "model-a"))
        assert a0 in a_now and len(a_now & b_engines) == 2  # two engines of B changed model
        for name in a_now & b_engines:  # the engines say so themselves
            st = httpx.get(f"{pool.engines[name].url}/kascade/v1/status", timeout=5,
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert (st["model"], st["modelService"], st["phase"]) == ("model-a", "model-a", "serving"), st
        assert serving(cp, ns, "model-b") and len(serving(cp, ns, "model-b")) == 1  # B at its min
        events = [e for e in get(cp, ns, "events")["items"] if e["involvedObject"].get("name") == "model-b"]
        assert sum(1 for e in events if e["reason"] == "Preempted") >= 2, [e["reason"] for e in events]
        assert any("priority 10 above 0" in e["message"] for e in events if e["reason"] == "Preempted")
        # the plans that bound B's released engines for A: from A's serving replicas (gpu sources), timed
        plans = [p for p in get(cp, ns, "splan")["items"] if p["spec"]["modelServiceRef"]["name"] == "model-a"
                 and {t["pod"] for t in p["spec"]["targets"]} & b_engines]
        assert plans and all(p["status"]["phase"] == "Succeeded" for p in plans), plans
        srcs = [(s["kind"], s.get("pod")) for p in plans for s in p["spec"]["sources"]]
        assert srcs and all(kind == "gpu" and pod in a_now for kind, pod in srcs), srcs
        switch_s = [ts(p["status"]["completionTime"]) - ts(p["metadata"]["creationTimestamp"]) for p in plans]
        durations = [float(p["status"].get("durationSeconds") or 0) for p in plans]
        during = gen_a.summary(since=t_burst)
        assert during["failed"] == 0 and during["ok"] > 20, during

        # A's burst ends (A back to its min after 1 s), B's load returns: B grows on the engines A released
        gen_a.set_load(workers=0)
        gen_b.set_load(workers=6)
        t_b = time.monotonic()
        wait_for(lambda: len(serving(cp, ns, "model-b")) == 3, 180, "B back at 3 replicas")
        t_back = time.monotonic()
        assert len(serving(cp, ns, "model-a")) == 1
        wait_for(lambda: not (get(cp, ns, "msvc", "model-b")["status"].get("arbitration")), 30,
                 "B's arbitration status cleared")
    finally:
        gen_a.stop()
        gen_b.stop()
    for name, g in (("A", gen_a), ("B", gen_b)):
        s = g.summary()
        assert s["failed"] == 0 and s["ok"] > 0, (name, s, g.failures()[:5])
    print(f"\nB's status.arbitration while preempted: {seen[:1]}\n"
          f"A 1 -> 3 on B's engines: {t_up - t_burst:.1f} s after the burst; decision (ScalePlan created) -> "
          f"serving A on a released engine of B: {', '.join(f'{x:.2f}' for x in switch_s)} s "
          f"(plan durationSeconds {', '.join(f'{x:.2f}' for x in durations)}); B 1 -> 3 again: {t_back - t_b:.1f} s"
          f"\nrequests A {gen_a.summary()}\nrequests B {gen_b.summary()}")
    assert seen and seen[0]["rankedAbove"] == ["model-a"] and seen[0]["preempted"], seen
