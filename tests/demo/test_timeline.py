"""The demo's record (pure): observations in, the story's events and a plot out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kascade_demo.timeline import Sample, Timeline, describe_plan, plot

LEAF = {"n0": "leaf-0", "n1": "leaf-1", "n2": "leaf-0"}
CHAIN = {"algorithm": "chain", "predictedSeconds": 0.004,
         "sources": [{"instance": "e0", "node": "n0", "kind": "gpu"}],
         "targets": [{"instance": "e2", "node": "n2"}, {"instance": "e1", "node": "n1"}],
         "chains": [["e0", "e2", "e1"]], "livePairs": [{"overloaded": "e0", "loading": "e2"}]}


def pod(name: str, node: str, **ann: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {f"kascade.io/{k}": v for k, v in ann.items()}},
            "spec": {"nodeName": node}}


def plan(phase: str | None, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "up-1", "creationTimestamp": "2026-11-22T15:00:00Z"}, "spec": CHAIN,
            "status": {"phase": phase, **status} if phase else {}}


def s(t: float, ready: int) -> Sample:
    return Sample(t, ready, 0, 0, 1.0, 40.0, 50.0)


def test_plan_is_told_with_leaves_live_pair_and_prediction() -> None:
    text = describe_plan("up-1", CHAIN, LEAF)
    assert text == ("ScalePlan up-1 (chain, predicted 4.00 ms at the links' rates): e0[leaf-0] -> e2[leaf-0] -> "
                    "e1[leaf-1]; live: e2 with e0")
    # a tiny model's plan: well under a millisecond is said as such, never "0 ms"
    for sec, said in ((0.00042, "0.42 ms"), (0.000003, "3 us"), (0.25, "250 ms"), (2.5, "2.50 s")):
        assert f"predicted {said} at" in describe_plan("up-1", {**CHAIN, "predictedSeconds": sec}, LEAF), sec
    local = {"algorithm": "local", "sources": [{"instance": "h", "kind": "host", "path": "/models/m"}],
             "targets": [{"instance": "e0", "node": "n0"}]}
    assert describe_plan("p", local, LEAF) == "ScalePlan p (local): first copy from /models/m into e0[leaf-0]"


def test_observations_become_one_event_per_change() -> None:
    tl = Timeline()
    msvc = {"status": {"lastDecision": {"time": "t1", "from": 1, "to": 3, "reason": "threshold: 750 > 300",
                                        "metrics": {"upper": 300.0}}}}
    evs = tl.observe(1.0, msvc, [plan(None)], [pod("e0", "n0", loaded="true")], LEAF, s(1.0, 1))
    assert [e.kind for e in evs] == ["decision", "plan", "ready"]
    assert "1 -> 3 replicas (threshold: 750 > 300) [upper=300]" in evs[0].text
    running = plan("Live", progress="3/20", targets=[{"instance": "e2", "blocksReceived": 2, "blocksTotal": 10},
                                                    {"instance": "e1", "blocksReceived": 1, "blocksTotal": 10}])
    evs = tl.observe(2.0, msvc, [running], [pod("e0", "n0", loaded="true"), pod("e2", "n2", live="true")], LEAF,
                     s(2.0, 1))
    assert [e.kind for e in evs] == ["flow", "live"] and "e2 2/10, e1 1/10" in evs[0].text
    assert tl.observe(2.5, msvc, [running], [pod("e0", "n0", loaded="true")], LEAF, s(2.5, 1)) == []  # nothing new
    done = plan("Succeeded", durationSeconds=3.5, targetsReady="2/2", bandwidthGbps=0.1)
    pods = [pod(n, node, loaded="true") for n, node in (("e0", "n0"), ("e1", "n1"), ("e2", "n2"))]
    evs = tl.observe(3.0, msvc, [done], pods, LEAF, s(3.0, 3))
    assert [e.kind for e in evs] == [
        "done",
        "ready",
        "ready",
    ] and "Succeeded in 3.5 s (2/2 targets, 0.10 Gbit/s)" in evs[0].text
    evs = tl.observe(9.0, msvc, [done], pods[:1], LEAF, s(9.0, 1))
    assert [(e.kind, e.text.split()[0]) for e in evs] == [("release", "e1"), ("release", "e2")]
    assert len(tl.samples) == 5


def test_plot_is_a_png(tmp_path: Path) -> None:
    tl = Timeline()
    tl.add(0.5, "load", "burst: 6 concurrent clients")
    for i in range(5):
        tl.observe(float(i), {}, [], [], LEAF, Sample(float(i), 1 + i % 2, i % 2, 0, 2.0, 80.0 * i, 40.0 + i))
    tl.add(3.5, "load", "calm")
    out = plot(tl, tmp_path / "d" / "demo.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
