"""Where the operator reaches an engine: the pod IP at the named container ports in a cluster (what
the chart's pool pods declare), an annotation when the harness or a human sets one."""

from __future__ import annotations

from typing import Any

from kascade_operator import labels as L
from kascade_operator.pool import pod_view


def raw(annotations: dict[str, str] | None = None, ip: str | None = "10.1.2.3") -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": 8000}, {"name": "data", "containerPort": 18515},
             {"name": "act", "containerPort": 18516}, {"containerPort": 9999}]
    return {"metadata": {"name": "e", "labels": {L.POOL: L.POOL_WARM}, "annotations": annotations or {}},
            "spec": {"nodeName": "n", "containers": [{"name": "engine", "ports": ports}]},
            "status": {"podIP": ip} if ip else {}}


def test_cluster_pod_is_reached_at_pod_ip_and_named_ports() -> None:
    p = pod_view(raw())
    assert (p.endpoint, p.data_endpoint, p.act_endpoint) == ("10.1.2.3:8000", "10.1.2.3:18515", "10.1.2.3:18516")


def test_annotation_wins_and_no_ip_means_no_address() -> None:
    p = pod_view(raw({L.ENDPOINT: "127.0.0.1:7000"}))
    assert p.endpoint == "127.0.0.1:7000" and p.data_endpoint == "10.1.2.3:18515"
    q = pod_view(raw(ip=None))
    assert (q.endpoint, q.data_endpoint, q.act_endpoint) == (None, None, None)


def test_a_pod_whose_engine_has_not_started_is_not_a_target() -> None:
    from kascade_operator.handlers import _slim_pod
    from kascade_operator.pool import usable_target

    def running(started: bool | None) -> dict[str, Any]:
        pod = raw()
        cs = {"name": "engine", "ready": False} | ({} if started is None else {"started": started})
        pod["status"] |= {"phase": "Running", "containerStatuses": [cs]}
        return _slim_pod(pod)  # what the operator's pod index keeps of it

    assert not usable_target(pod_view(running(False)))  # startupProbe (/healthz) not passed yet
    assert usable_target(pod_view(running(True)))
    assert usable_target(pod_view(running(None)))  # no startup information (KWOK, old kubelets): as before


def test_every_engine_pod_the_operator_or_chart_makes_has_a_startup_probe() -> None:
    from pathlib import Path

    import yaml
    from builders import spec

    from kascade_operator.podtemplate import fallback_pod
    fb = fallback_pod(spec(), "svc", "tok", None)["spec"]["containers"][0]
    assert fb["startupProbe"]["httpGet"]["path"] == "/healthz"
    pool = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests" / "pool" / "deployment.yaml").read_text())
    (engine,) = [c for c in pool["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert engine["startupProbe"]["httpGet"]["path"] == "/healthz"
