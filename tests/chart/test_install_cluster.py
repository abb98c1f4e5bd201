"""helm install / uninstall against the real control plane, and the plain manifests on the server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.nodes import KWOK_TOLERATION

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def _objects(cp: ControlPlane, ns: str, release: str) -> dict[str, list[str]]:
    sel = f"app.kubernetes.io/instance={release}"
    out = {}
    for kind in ("deployments", "serviceaccounts", "roles", "rolebindings", "secrets"):
        items = json.loads(cp.kubectl("-n", ns, "get", kind, "-l", sel, "-o", "json").stdout)["items"]
        out[kind] = sorted(i["metadata"]["name"] for i in items)
    for kind in ("clusterroles", "clusterrolebindings"):
        items = json.loads(cp.kubectl("get", kind, "-l", sel, "-o", "json").stdout)["items"]
        out[kind] = sorted(i["metadata"]["name"] for i in items)
    return out


def test_helm_install_creates_and_uninstall_removes(control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]],
                                                    namespace: str, tmp_path: Path) -> None:
    kwok_nodes(2, gpus=2)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"pool": {"replicas": 3, "tolerations": [KWOK_TOLERATION]},
                                      "operator": {"tolerations": [KWOK_TOLERATION]},
                                      "router": {"tolerations": [KWOK_TOLERATION]}}))
    control_plane.helm("install", "kc", str(REPO / "charts/kascade"), "-n", namespace, "-f", str(values), "--wait",
                       "--timeout=90s")
    objs = _objects(control_plane, namespace, "kc")
    # the router (the front door) is on by default, and --wait saw its replicas available
    assert objs["deployments"] == ["kc-operator", "kc-pool", "kc-router"]
    assert objs["clusterroles"] == ["kc-edit", "kc-operator", "kc-router", "kc-view"]
    assert objs["clusterrolebindings"] == ["kc-operator", "kc-router"]
    router = json.loads(control_plane.kubectl("-n", namespace, "get", "deployment", "kc-router", "-o", "json").stdout)
    assert router["status"].get("availableReplicas") == router["spec"]["replicas"] == 2, router["status"]
    assert objs["roles"] == ["kc-operator-token"] and objs["secrets"] == []  # the operator makes the token Secret
    assert objs["serviceaccounts"] == ["kc-operator", "kc-router"]
    crds = control_plane.kubectl("get", "crd", "modelservices.kascade.io", "scaleplans.kascade.io", "-o", "name").stdout
    assert len(crds.split()) == 2
    pool = json.loads(control_plane.kubectl("-n", namespace, "get", "pods", "-l", "kascade.io/pool=warm",
                                            "-o", "json").stdout)["items"]
    assert len(pool) == 3 and {p["status"]["phase"] for p in pool} == {"Running"}
    # Binding relabels a pod kascade.io/pool=bound (what the operator's bind patch does): the ReplicaSet
    # lets it go and starts a fresh idle pod, so the warm pool refills on its own.
    first = pool[0]["metadata"]["name"]
    control_plane.kubectl("-n", namespace, "label", "pod", first, "kascade.io/pool=bound",
                          "kascade.io/model-service=svc", "--overwrite")

    def pods(sel: str) -> list[dict[str, Any]]:
        return json.loads(control_plane.kubectl("-n", namespace, "get", "pods", "-l", sel, "-o", "json").stdout)[
            "items"
        ]

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(pods("kascade.io/pool=warm")) < 3:
        time.sleep(0.2)
    warm, bound = pods("kascade.io/pool=warm"), pods("kascade.io/pool=bound")
    assert len(warm) == 3 and first not in {p["metadata"]["name"] for p in warm}
    assert [p["metadata"]["name"] for p in bound] == [first] and not bound[0]["metadata"].get("ownerReferences")
    # The operator's service account can read its token Secret but not list Secrets.
    sa = f"system:serviceaccount:{namespace}:kc-operator"
    can = lambda *a: control_plane.kubectl("auth", "can-i", *a, "--as", sa, "-n", namespace, check=False).stdout.strip()  # noqa: E731
    assert can("get", "secret/kc-engine-token") == "yes"
    assert can("list", "secrets") == "no"
    assert can("patch", "modelservices.kascade.io/status") == "yes"
    assert can("patch", "pods", "--subresource=status") == "yes"  # the serving readiness gate
    assert can("delete", "nodes") == "no"

    control_plane.helm("uninstall", "kc", "-n", namespace, "--wait", "--timeout=60s")
    after = _objects(control_plane, namespace, "kc")
    assert all(not v for v in after.values()), after


def test_plain_manifests_accepted_by_server(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "-f", str(REPO / "manifests/namespace.yaml"))
    files = [p for p in sorted((REPO / "manifests").rglob("*.yaml")) if "samples" not in p.parts]
    args = [a for p in files for a in ("-f", str(p))]
    out = control_plane.kubectl("apply", "--dry-run=server", *args).stdout
    for name in (
        "deployment.apps/kascade-operator",
        "deployment.apps/kascade-pool",
        "clusterrole.rbac.authorization.k8s.io/kascade-operator",
        "secret/kascade-engine-token",
        "serviceaccount/kascade-operator",
    ):
        assert name in out, out
