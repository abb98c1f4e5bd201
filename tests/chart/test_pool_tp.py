"""The warm pool with tensor-parallel engines (pool.engine.tp, docs/tp.md): g ranks per pod, one data port per rank
(data, data-r1, ... = dataPort + r), g GPUs, the annotation a TP-g ModelService binds by, and the refusals at render
that name the values (GPUs per pod, the act port colliding with a rank port, TLS, the node cache)."""

from __future__ import annotations

import pytest
from test_chart import CHART, Helm, by, render

from kascade_operator import labels as L
from kascade_operator.pool import can_serve, pod_view


def test_tp2_pool_pods_run_two_ranks_with_a_data_port_each_and_bind_only_tp2_services(helm: Helm) -> None:
    docs = render(helm, "--set", "pool.engine.tp=2", "--set", "pool.gpusPerPod=2", "--set", "pool.actPort=18517")
    tmpl = by(docs, "Deployment", "rel-pool")["spec"]["template"]
    c = tmpl["spec"]["containers"][0]
    assert "--tp=2" in c["args"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "data": 18515, "data-r1": 18516,
                                                                    "act": 18517}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert tmpl["metadata"]["annotations"][L.ENGINE_TP] == "2"
    view = pod_view({"metadata": {"name": "p", "labels": {L.POOL: L.POOL_WARM},
                                  "annotations": tmpl["metadata"]["annotations"]}})
    model = tmpl["metadata"]["annotations"][L.MODEL]
    assert can_serve(view, model, "svc", None, 2) and not can_serve(view, model, "svc", None, 1)
    one = by(render(helm), "Deployment", "rel-pool")["spec"]["template"]
    c1 = one["spec"]["containers"][0]
    assert not any(a.startswith("--tp") for a in c1["args"]) and L.ENGINE_TP not in one["metadata"]["annotations"]
    assert {p["name"] for p in c1["ports"]} == {"http", "data", "act"}


@pytest.mark.parametrize("values, says", [
    (["pool.engine.tp=2"], "pool.gpusPerPod 1 must equal pool.engine.tp 2"),
    (["pool.engine.tp=2", "pool.gpusPerPod=2"], "pool.actPort 18516 collides with the rank data ports"),
    (["pool.engine.tp=2", "pool.gpusPerPod=2", "pool.actPort=18517", "dataPlaneTls.secretName=tls"],
     "pool.engine.tp 2 with dataPlaneTls.secretName"),
    (["pool.engine.tp=2", "pool.gpusPerPod=2", "pool.actPort=18517", "pool.nodeCache.enabled=true"],
     "pool.engine.tp 2 with pool.nodeCache.enabled"),
    (["pool.engine.tp=0"], "tp"),
    (["pool.engine.tp=2", "pool.gpusPerPod=2", "pool.actPort=18517", "pool.extraArgs={--tp=4}"], "pool.engine.tp"),
])
def test_tp_pool_values_that_cannot_run_are_refused_naming_them(helm: Helm, values: list[str], says: str) -> None:
    args = [a for v in values for a in ("--set", v)]
    out = helm("template", "rel", str(CHART), "-n", "ns", *args, check=False)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-1500:]
