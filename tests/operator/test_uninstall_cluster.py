"""Issue 32: after `helm uninstall` a ModelService kept the operator's finalizer with no operator left to remove
it, so deleting it (or its namespace) hung for ever. The chart's pre-delete hook runs `kascade operator
uninstall`: operator Deployment scaled to 0, engines released, finalizer removed. Here on the real API server
(kube-controller-manager included), the operator a real process, engines loopback stubs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from enginestub import EngineStub

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.nodes import KWOK_TOLERATION
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster
TOKEN = "uninstall-test-token"
FINALIZER = "kascade.io/finalizer"


def kget(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def apply(cp: ControlPlane, ns: str, doc: dict[str, Any]) -> None:
    cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(doc))


def test_uninstall_stops_the_operator_releases_engines_and_lets_modelservices_go(
        control_plane: ControlPlane, namespace: str, op: OperatorProcess,
        kwok_nodes: Callable[..., list[str]]) -> None:
    cp, ns = control_plane, namespace
    (node,) = kwok_nodes(1)
    stub = EngineStub("e0", "tiny", TOKEN, auto_ready=True)
    try:
        apply(cp, ns, {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "e0", "labels": {"kascade.io/pool": "warm"},
                                    "annotations": {"kascade.io/endpoint": stub.endpoint, "kascade.io/model": "tiny"}},
                       "spec": {"nodeName": node, "tolerations": [KWOK_TOLERATION],
                                "containers": [{"name": "engine", "image": "kascade:dev"}]}})
        # stands for the chart's operator Deployment (its pods never schedule: the operator is the process)
        apply(cp, ns, {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "rel-operator"},
                       "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "op"}},
                                "template": {"metadata": {"labels": {"app": "op"}},
                                             "spec": {"nodeSelector": {"nowhere": "true"},
                                                      "containers": [{"name": "c", "image": "x"}]}}}})
        op.start()
        apply(cp, ns, {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "svc"},
                       "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                                "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 1, "max": 1}}}})
        wait_for(lambda: kget(cp, ns, "pods", "e0")["metadata"].get("labels", {}).get("kascade.io/model-service")
                 == "svc", what="e0 bound")
        assert FINALIZER in kget(cp, ns, "msvc", "svc")["metadata"]["finalizers"]
        wait_for(lambda: kget(cp, ns, "pods", "-l", "app=op")["items"], what="the Deployment's pod")
        op.stop()  # what the scale to 0 does to the chart's operator pods
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "KASCADE_OPERATOR_NAMESPACES": json.dumps([ns]),
               "KASCADE_OPERATOR_ENGINE_TOKEN": TOKEN}
        out = subprocess.run([sys.executable, "-m", "kascade_cli.main", "operator", "uninstall",
                              "--deployment", "rel-operator", "--deployment-namespace", ns, "--wait", "30"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "1 ModelService(s) let go" in out.stdout, out.stdout + out.stderr
        assert kget(cp, ns, "deployment", "rel-operator")["spec"]["replicas"] == 0
        assert not kget(cp, ns, "pods", "-l", "app=op")["items"]  # waited for
        assert FINALIZER not in (kget(cp, ns, "msvc", "svc")["metadata"].get("finalizers") or []), out.stderr
        assert stub.count("release") == 1
        pod = kget(cp, ns, "pods", "e0")["metadata"]
        assert "kascade.io/model-service" not in (pod.get("labels") or {}) and not pod.get("ownerReferences")
        # no operator: the ModelService is deleted at once (it used to wait for ever)
        cp.kubectl("-n", ns, "delete", "msvc", "svc", "--timeout=20s")
        assert not kget(cp, ns, "msvc")["items"]
    finally:
        stub.close()


def test_the_finalizer_goes_even_when_the_modelservice_changed_since_it_was_listed(
        control_plane: ControlPlane, crds: list[str], namespace: str) -> None:
    """Found by the kind story: releasing a ModelService's engines (or an operator still stopping) changes it
    after the hook listed it, and a finalizer patch carrying the listed resourceVersion was refused (409), so
    the finalizer stayed. The hook reads it again before each attempt."""
    import asyncio

    from kascade_operator.engine_client import EngineClient
    from kascade_operator.kube import Kube
    from kascade_operator.operator_metrics import OperatorMetrics
    from kascade_operator.runtime import Runtime
    from kascade_operator.settings import OperatorSettings
    from kascade_operator.uninstall import let_go

    cp, ns = control_plane, namespace
    apply(cp, ns, {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService",
                   "metadata": {"name": "svc", "finalizers": [FINALIZER]},
                   "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                            "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 0, "max": 1}}}})
    listed = kget(cp, ns, "msvc", "svc")
    cp.kubectl("-n", ns, "annotate", "msvc", "svc", "example.com/touched=yes")  # a newer resourceVersion
    assert kget(cp, ns, "msvc", "svc")["metadata"]["resourceVersion"] != listed["metadata"]["resourceVersion"]

    async def run() -> None:
        kube = await Kube.connect(str(cp.kubeconfig))
        engines = EngineClient(TOKEN, 5.0)
        try:
            await let_go(Runtime(OperatorSettings(), kube, engines, None, None, OperatorMetrics()), listed)
        finally:
            await engines.aclose()
            await kube.close()

    asyncio.run(run())
    assert FINALIZER not in (kget(cp, ns, "msvc", "svc")["metadata"].get("finalizers") or [])
    cp.kubectl("-n", ns, "delete", "msvc", "svc", "--timeout=20s")


def test_what_the_hook_cannot_clean_up_is_said_in_events_and_it_still_exits_0(
        control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]]) -> None:
    """The hook never blocks `helm uninstall` (exit 0), but what it leaves is not silent: a bound pod whose
    engine does not answer (not released) and an operator pod that will not go (a pod of the Deployment's
    selector it does not own) are named in a warning line and in Warning Events, reason UninstallIncomplete,
    on the ModelService and on the operator Deployment. The finalizer goes all the same."""
    cp, ns = control_plane, namespace
    (node,) = kwok_nodes(1)
    apply(cp, ns, {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService",
                   "metadata": {"name": "svc", "finalizers": [FINALIZER]},
                   "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                            "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 0, "max": 1}}}})
    # bound to svc; its engine's port refuses every connection
    apply(cp, ns, {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "e0", "labels": {"kascade.io/pool": "bound", "kascade.io/model-service": "svc"},
                                "annotations": {"kascade.io/endpoint": "127.0.0.1:1", "kascade.io/model": "tiny"}},
                   "spec": {"nodeName": node, "tolerations": [KWOK_TOLERATION],
                            "containers": [{"name": "engine", "image": "kascade:dev"}]}})
    apply(cp, ns, {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "rel-operator"},
                   "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "op"}},
                            "template": {"metadata": {"labels": {"app": "op"}},
                                         "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
    apply(cp, ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stray-op", "labels": {"app": "op"}},
                   "spec": {"nodeName": node, "tolerations": [KWOK_TOLERATION],
                            "containers": [{"name": "c", "image": "x"}]}})
    env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "KASCADE_OPERATOR_NAMESPACES": json.dumps([ns]),
           "KASCADE_OPERATOR_ENGINE_TOKEN": TOKEN, "KASCADE_OPERATOR_ENGINE_TIMEOUT_SECONDS": "2"}
    out = subprocess.run([sys.executable, "-m", "kascade_cli.main", "operator", "uninstall",
                          "--deployment", "rel-operator", "--deployment-namespace", ns, "--wait", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 ModelService(s) let go" in out.stdout, out.stdout + out.stderr
    assert f"not cleaned up: ModelService {ns}/svc: pod {ns}/e0: engine not released" in out.stderr, out.stderr
    assert "not cleaned up: operator pods in" in out.stderr and "stray-op" in out.stderr, out.stderr
    assert FINALIZER not in (kget(cp, ns, "msvc", "svc")["metadata"].get("finalizers") or [])

    def incomplete(kind: str, name: str) -> list[dict[str, Any]]:
        return [e for e in kget(cp, ns, "events")["items"] if e["reason"] == "UninstallIncomplete"
                and e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == name]

    (on_svc,) = incomplete("ModelService", "svc")
    assert on_svc["type"] == "Warning" and f"pod {ns}/e0: engine not released" in on_svc["message"], on_svc
    assert on_svc["involvedObject"]["uid"] == kget(cp, ns, "msvc", "svc")["metadata"]["uid"]
    (on_op,) = incomplete("Deployment", "rel-operator")
    assert on_op["involvedObject"]["apiVersion"] == "apps/v1" and "stray-op" in on_op["message"], on_op
