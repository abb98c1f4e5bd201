"""Issue 32, found by the kind story: how the chart's pods start and stop. The router drains before SIGTERM
(preStop) and its grace period covers the drain; the operator has a startupProbe so liveness never kills a
slow start."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]


def render(helm: Helm, *sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    return [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-n", "ns", *args).stdout) if d]


def pod_spec(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
    return dict(dep["spec"]["template"]["spec"])


def test_router_sleeps_before_sigterm_and_its_grace_covers_the_drain(helm: Helm) -> None:
    spec = pod_spec(render(helm), "rel-router")
    (c,) = spec["containers"]
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    assert "--drain-timeout=60" in c["args"]
    assert spec["terminationGracePeriodSeconds"] == 5 + 60 + 5
    spec = pod_spec(render(helm, "router.preStopSeconds=0", "router.drainSeconds=10"), "rel-router")
    assert "lifecycle" not in spec["containers"][0] and spec["terminationGracePeriodSeconds"] == 15
    bad = helm("template", "rel", str(CHART), "--set", "router.preStopSeconds=-1", check=False)
    assert bad.returncode != 0 and "preStopSeconds" in bad.stderr


def test_operator_has_a_startup_probe_before_liveness(helm: Helm) -> None:
    (c,) = pod_spec(render(helm), "rel-operator")["containers"]
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    assert c["livenessProbe"]["httpGet"] == c["startupProbe"]["httpGet"]


def test_uninstall_hook_stops_the_operator_and_lets_modelservices_go(helm: Helm) -> None:
    """`helm uninstall` runs `kascade operator uninstall` before deleting anything (a pre-delete hook Job with
    the operator's account, labels and token settings); its Role may scale only the operator Deployment."""
    docs = render(helm)
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "rel-operator-uninstall")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    spec = job["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "rel-operator" and spec["restartPolicy"] == "Never"
    # found on kind: Service links put KASCADE_OPERATOR_METRICS_PORT=tcp://... into the settings' prefix
    assert spec["enableServiceLinks"] is False
    (c,) = spec["containers"]
    assert c["args"][:3] == ["kascade", "operator", "uninstall"] and "--deployment=rel-operator" in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"] == "rel-engine-token"
    assert env["KASCADE_OPERATOR_ENGINE_TOKEN_NAMESPACE"] == "ns"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator-token")
    assert {"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"],
            "resourceNames": ["rel-operator"], "verbs": ["get", "patch"]} in role["rules"]
    # its Events on that Deployment (what it could not clean up), even when the release namespace is not watched
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]} in role["rules"]
    off = render(helm, "operator.uninstallHook=false")
    assert not [d for d in off if d["kind"] == "Job"]
    role = next(d for d in off if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator-token")
    assert all(r["apiGroups"] != ["apps"] and r["resources"] != ["events"] for r in role["rules"])


def test_router_signs_prefill_peers_and_pool_engines_demand_it(helm: Helm) -> None:
    """Issue 38: the router gets the engine token to sign X-Kascade-Prefill; pool engines dial no unsigned peer."""
    docs = render(helm)
    (router,) = pod_spec(docs, "rel-router")["containers"]
    env = {e["name"]: e for e in router["env"]}
    assert env["KASCADE_ROUTER_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rel-engine-token",
                                                                                 "key": "token"}
    engine = next(c for c in pod_spec(docs, "rel-pool")["containers"] if c["name"] == "engine")
    assert "--require-prefill-signature" in engine["args"]
    off = render(helm, "router.signPrefillPeers=false")
    assert "env" not in pod_spec(off, "rel-router")["containers"][0]
    engine = next(c for c in pod_spec(off, "rel-pool")["containers"] if c["name"] == "engine")
    assert "--require-prefill-signature" not in engine["args"]


def test_no_pod_gets_service_links(helm: Helm) -> None:
    """Every pod the chart makes (Deployments, the uninstall Job, the `helm test` Pod) and the operator's
    fallback pods run without Service environment variables: a Service named `<release>-operator-metrics`
    makes KASCADE_OPERATOR_METRICS_PORT=tcp://... in every pod of its namespace, inside the operator's
    settings prefix (found on kind); none of these processes reads Service variables (in-cluster clients use
    KUBERNETES_SERVICE_HOST, which Kubernetes sets regardless)."""
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    docs = render(helm, "tests.enabled=true", "operator.uninstallHook=true")
    specs = {f"{d['kind']}/{d['metadata']['name']}": d["spec"] if d["kind"] == "Pod" else
             d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job", "Pod", "DaemonSet")}
    assert {"Deployment/rel-operator", "Deployment/rel-router", "Deployment/rel-pool",
            "Job/rel-operator-uninstall", "Pod/rel-test-models"} <= set(specs), sorted(specs)
    assert {n: s.get("enableServiceLinks") for n, s in specs.items()} == dict.fromkeys(specs, False)
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": "/models/m1"}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    assert fallback_pod(spec, "svc", "tok", None)["spec"]["enableServiceLinks"] is False
