"""The chart's ports, checked without a cluster: Services, ServiceMonitor/PodMonitor, NetworkPolicies and probes
name ports the selected pods declare, and each declared port is one the container's `kascade` command listens on
(the chart rendered by `helm template`, the commands parsed by the real CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from images import MONITORS, Helm, rendered


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in sel.items() if k != "matchExpressions"):
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        missing_in = e["operator"] == "In" and labels.get(e["key"]) not in e["values"]
        if (e["operator"] == "Exists" and not present) or missing_in:
            return False
    return True


@pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")
def test_every_port_the_chart_wires_is_declared_and_listened_on(helm: Helm, tmp_path: Path) -> None:
    """Services, ServiceMonitor/PodMonitor, NetworkPolicies and probes name ports the selected pods declare,
    and each declared port is one the container's `kascade` command listens on (parsed by the real CLI);
    the data port is the one the operator hands to engines in plans (from the port named `data`)."""
    from urllib.parse import urlparse

    import click

    from kascade_cli.main import cli
    from kascade_operator import labels as L
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod
    from kascade_operator.pool import pod_view

    (tmp_path / "m").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    docs = rendered(
        helm,
        *MONITORS,
        "--set",
        f"pool.model.mountPath={tmp_path}",
        "--set",
        f"pool.model.path={tmp_path / 'm'}",
    )
    # a pool pod serving: the operator's serving label added (what the engines Service selects)
    serving = {"kascade.io/serving": "true"}
    pods = [
        (
            d["metadata"]["name"],
            {**d["spec"]["template"]["metadata"]["labels"], **(serving if d["metadata"]["name"] == "rel-pool" else {})},
            d["spec"]["template"]["spec"],
        )
        for d in docs
        if d["kind"] == "Deployment"
    ]
    spec = ModelServiceSpec.model_validate(
        {
            "model": {"name": "m", "source": {"path": str(tmp_path / "m")}},
            "engine": {"image": "i:1", "port": 8100, "dataPort": 18600},
            "mode": "colocated",
            "replicas": {"colocated": {"min": 1, "max": 2}},
        }
    )
    fb = fallback_pod(spec, "svc", "tok", None)  # a service's own engine ports, unlike the pool's
    all_pods = [*pods, ("fallback", fb["metadata"]["labels"], fb["spec"])]

    def ports(pod_spec: dict[str, Any]) -> dict[str | int, int]:
        out: dict[str | int, int] = {}
        for c in pod_spec["containers"]:
            for p in c.get("ports", []):
                out[p["containerPort"]] = p["containerPort"]
                if "name" in p:
                    out[p["name"]] = p["containerPort"]
        return out

    for name, _, pod_spec in all_pods:
        for c in pod_spec["containers"]:
            declared = {p["containerPort"] for p in c.get("ports", []) if p.get("name") != "data"}
            ctx = cli.make_context("kascade", list(c["args"][1:]))
            group: click.Command = cli
            rest = ctx.protected_args + ctx.args
            while isinstance(group, click.Group):
                cmd_name, cmd, rest = group.resolve_command(ctx, rest)
                assert cmd is not None
                ctx = cmd.make_context(cmd_name or "", rest, parent=ctx)
                group, rest = cmd, (ctx.protected_args + ctx.args if isinstance(cmd, click.Group) else [])
            listening: set[int | None] = {
                v for k, v in ctx.params.items() if k.endswith("port") and isinstance(v, int) and v
            }
            listening |= {
                urlparse(v).port for v in ctx.params.values() if isinstance(v, str) and v.startswith("http://0.0.0.0")
            }
            assert declared == listening, f"{name}/{c['name']}: declares {declared}, listens on {listening}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in ports(pod_spec), f"{name}/{c['name']} {probe}"
        if "data" in ports(pod_spec):  # the operator reads the data endpoint from the port named `data`
            view = pod_view(
                {"metadata": {"name": name, "labels": {}}, "spec": pod_spec, "status": {"podIP": "10.0.0.9"}}
            )
            assert view.data_endpoint == f"10.0.0.9:{ports(pod_spec)['data']}", name
            assert L.DATA_ENDPOINT == "kascade.io/data-endpoint"

    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"rel-engines", "rel-operator-metrics", "rel-router"}
    for svc in services:
        selected = [p for p in pods if _selects(svc["spec"]["selector"], p[1])]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for sp in svc["spec"]["ports"]:
            for name, _, pod_spec in selected:
                assert sp["targetPort"] in ports(pod_spec), (
                    f"Service {svc['metadata']['name']} -> {name}: {sp['targetPort']}"
                )
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert {m["kind"] for m in monitors} == {"ServiceMonitor", "PodMonitor"}
    for m in monitors:
        if m["kind"] == "ServiceMonitor":
            svcs = [s for s in services if _selects(m["spec"]["selector"], s["metadata"]["labels"])]
            assert svcs, m["metadata"]["name"]
            for e in m["spec"]["endpoints"]:
                assert all(e["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in svcs), (
                    m["metadata"]["name"],
                    e,
                )
        else:
            selected = [p for p in all_pods if _selects(m["spec"]["selector"], p[1])]
            assert {p[0] for p in selected} >= {"rel-pool", "fallback"}, [p[0] for p in selected]
            for e in m["spec"]["podMetricsEndpoints"]:
                assert all(e["port"] in ports(p[2]) for p in selected), (m["metadata"]["name"], e)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policies
    for pol in policies:
        selected = [p for p in all_pods if _selects(pol["spec"]["podSelector"], p[1])]
        assert selected, pol["metadata"]["name"]
        for rule in pol["spec"].get("ingress", []):
            for rp in rule.get("ports", []):
                assert all(rp["port"] in ports(p[2]) for p in selected), (
                    pol["metadata"]["name"],
                    rp,
                    [p[0] for p in selected],
                )
