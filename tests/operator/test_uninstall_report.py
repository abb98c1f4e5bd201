"""The uninstall hook's report on the fake kube layer: what `kascade operator uninstall` could not clean up is
named, never swallowed. `plandriver.release_all` returns each engine it could not drain or release (a real
HTTP call to a port that refuses it) while it still unbinds the pod, and `uninstall.report` posts the
leftovers as Warning Events (UninstallIncomplete) on the ModelService and on the operator Deployment, and
logs them on one line. The whole hook on the real API server: test_uninstall_cluster.py."""

from __future__ import annotations

import logging

import pytest
from fakekube import FakeKube, merge

from kascade_operator import labels as L
from kascade_operator import plandriver
from kascade_operator.engine_client import EngineClient
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings
from kascade_operator.uninstall import INCOMPLETE, Leftovers, report

NS = "ns"
BODY = {"metadata": {"name": "svc", "namespace": NS, "uid": "uid-svc"}}


async def test_release_all_names_the_engines_it_could_not_release_and_unbinds_their_pods() -> None:
    kube = FakeKube()
    kube.add_pool_pod(NS, "e0", "n0", "127.0.0.1:1")  # nothing listens there: connection refused
    merge(kube.pods[(NS, "e0")], {"metadata": {"labels": {L.POOL: L.POOL_BOUND, L.MODEL_SERVICE: "svc"}}})
    kube.add_pool_pod(NS, "idle", "n0", "127.0.0.1:1")  # not the service's: untouched, not reported
    rt = Runtime(OperatorSettings(engine_token="t"), kube, EngineClient("t", 2.0), None, None, OperatorMetrics())
    try:
        problems = await plandriver.release_all(rt, BODY)
    finally:
        await rt.engines.aclose()
    assert [p.split(" (")[0] for p in problems] == [f"pod {NS}/e0: engine not drained",
                                                    f"pod {NS}/e0: engine not released"], problems
    assert "127.0.0.1:1" in problems[1], problems
    labels = kube.pods[(NS, "e0")]["metadata"]["labels"]
    assert labels[L.POOL] == L.POOL_WARM and L.MODEL_SERVICE not in labels  # back in the pool all the same


async def test_report_posts_what_was_left_on_the_service_and_the_operator(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    rt = Runtime(OperatorSettings(engine_token="t"), kube, EngineClient("t"), None, None, OperatorMetrics())
    left = Leftovers()
    left.service(BODY, "pod ns/e0: engine not released (refused)")
    left.installation.append("operator pods in kascade still running after 60 s: op-1")
    try:
        with caplog.at_level(logging.WARNING, logger="kascade_operator.uninstall"):
            await report(rt, left, "rel-operator", "kascade")
            await report(rt, Leftovers(), "rel-operator", "kascade")  # nothing left: nothing said
    finally:
        await rt.engines.aclose()
    assert [(e["namespace"], e["kind"], e["name"], e["apiVersion"], e["uid"], e["type"], e["reason"])
            for e in kube.events] == [
        (NS, "ModelService", "svc", "kascade.io/v1alpha1", "uid-svc", "Warning", INCOMPLETE),
        ("kascade", "Deployment", "rel-operator", "apps/v1", None, "Warning", INCOMPLETE)]
    assert kube.events[0]["message"].endswith("could not clean up: pod ns/e0: engine not released (refused)")
    assert kube.events[1]["message"].endswith("could not clean up: operator pods in kascade still running "
                                              "after 60 s: op-1")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("uninstall incomplete; clean up by hand: operator pods in kascade still running after 60 s: "
                    "op-1; ModelService ns/svc: pod ns/e0: engine not released (refused)")
