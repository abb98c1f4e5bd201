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
