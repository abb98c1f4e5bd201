"""The GitOps traps on the real control plane (issue 32 item 6): with the chart's defaults the token
Secret is made once by the operator (with the chart's own ServiceAccount and RBAC), and then neither a
`helm upgrade`, nor a GitOps-style `helm template | kubectl apply`, nor another operator replica changes
it, while the pool's engines reference exactly it; an idle pool pod is in no Service, a bound and loaded
one enters the engines Service when the operator's round labels it; namespace editors and viewers get
Kascade's objects through the aggregated roles.

No kubelet runs here (KWOK marks pods Running and Ready); the operator's pieces run as this process,
authenticated as the chart's ServiceAccount.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.kubeconfig import kubeconfig_text
from kascade_devcluster.localengine import start_engine
from kascade_devcluster.nodes import KWOK_TOLERATION
from kascade_devcluster.waiting import wait_for
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_operator import enginetoken, serving_gate
from kascade_operator import labels as L
from kascade_operator.engine_client import EngineClient, EngineError
from kascade_operator.kube import Kube

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"


def get(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def token(cp: ControlPlane, ns: str, name: str) -> str:
    return base64.b64decode(get(cp, ns, "secret", name)["data"]["token"]).decode()


async def as_operator(cp: ControlPlane, ns: str, release: str, tmp: Path) -> Kube:
    sa = cp.kubectl("-n", ns, "create", "token", f"{release}-operator", "--duration=1h").stdout.strip()
    path = tmp / f"{release}-operator.kubeconfig"
    path.write_text(kubeconfig_text(cp.api_url, cp.ca_cert, sa, user=f"{release}-operator"))
    return await Kube.connect(str(path))


def endpoints(cp: ControlPlane, ns: str, service: str) -> list[str]:
    slices = get(cp, ns, "endpointslices", "-l", f"kubernetes.io/service-name={service}")["items"]
    return sorted(e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or []
                  if (e.get("conditions") or {}).get("ready"))


def test_token_made_once_survives_upgrade_and_gitops_apply_and_serving_is_a_label(
        control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]], crds: list[str], namespace: str,
        tmp_path: Path) -> None:
    cp, ns = control_plane, namespace
    kwok_nodes(2, gpus=2)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"pool": {"replicas": 2, "tolerations": [KWOK_TOLERATION]},
                                      "operator": {"tolerations": [KWOK_TOLERATION]},
                                      "router": {"enabled": False}, "tests": {"enabled": False}}))
    cp.helm("install", "gx", str(CHART), "-n", ns, "-f", str(values), "--wait", "--timeout=90s")
    assert not get(cp, ns, "secrets", "-l", "app.kubernetes.io/instance=gx")["items"]  # nothing random rendered
    dep = get(cp, ns, "deployment", "gx-operator")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    name, create = env["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"], env["KASCADE_OPERATOR_ENGINE_TOKEN_CREATE"] == "true"

    async def operator_starts() -> list[str]:
        kubes = [await as_operator(cp, ns, "gx", tmp_path) for _ in range(2)]  # two replicas, racing
        try:
            return list(await asyncio.gather(*(enginetoken.ensure(k, env["KASCADE_OPERATOR_ENGINE_TOKEN_NAMESPACE"],
                                                                  name, create) for k in kubes)))
        finally:
            for k in kubes:
                await k.close()

    first = asyncio.run(operator_starts())
    assert len(set(first)) == 1 and token(cp, ns, name) == first[0]
    t = first[0]
    # every pool engine reads that Secret (the kubelet resolves this secretKeyRef at start)
    pods = get(cp, ns, "pods", "-l", "kascade.io/pool=warm")["items"]
    assert len(pods) == 2
    for p in pods:
        ref = next(e for e in p["spec"]["containers"][0]["env"] if e["name"] == "KASCADE_ENGINE_TOKEN")
        assert ref["valueFrom"]["secretKeyRef"] == {"name": name, "key": "token"}

    # the pieces agree: an engine started as the kubelet starts a pool pod (KASCADE_ENGINE_TOKEN from that
    # Secret) accepts the operator's control calls, and refuses a token it was not given
    ckpt = tiny_llama(tmp_path / "tiny", layers=2, hidden=64, vocab=512)
    engine = start_engine(["--empty", f"--checkpoint={ckpt}", "--model-name=tiny"], token=token(cp, ns, name))

    async def control(with_token: str) -> int:
        client = EngineClient(with_token)
        try:
            await client.status(f"127.0.0.1:{engine.http}")
            return 200
        except EngineError as e:
            return e.status or 0
        finally:
            await client.aclose()

    try:
        assert asyncio.run(control(t)) == 200 and asyncio.run(control("a-token-rendered-at-another-sync")) in (401, 403)
    finally:
        engine.stop()

    cp.helm("upgrade", "gx", str(CHART), "-n", ns, "-f", str(values), "--wait", "--timeout=90s")
    rendered = cp.helm("template", "gx", str(CHART), "-n", ns, "-f", str(values)).stdout  # how Argo CD renders
    cp.kubectl("-n", ns, "apply", "-f", "-", input=rendered)
    assert cp.helm("template", "gx", str(CHART), "-n", ns, "-f", str(values)).stdout == rendered
    assert token(cp, ns, name) == t and asyncio.run(operator_starts()) == [t, t]  # a restart adopts it

    # idle pool pods are Ready (available) and in no Service; a bound, loaded one enters when labelled
    pods = wait_for(lambda: [p for p in get(cp, ns, "pods", "-l", "kascade.io/pool=warm")["items"]
                             if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in p["status"].get("conditions") or [])
                             and not p["metadata"].get("deletionTimestamp")] or None, timeout=60,
                    what="Ready pool pods")
    pool = get(cp, ns, "deployment", "gx-pool")
    assert pool["status"].get("availableReplicas") == 2, pool["status"]
    assert endpoints(cp, ns, "gx-engines") == []
    chosen = pods[0]["metadata"]["name"]
    cp.kubectl("-n", ns, "label", "pod", chosen, f"{L.POOL}={L.POOL_BOUND}", f"{L.MODEL_SERVICE}=chat", "--overwrite")
    cp.kubectl("-n", ns, "annotate", "pod", chosen, f"{L.LOADED}=true")

    async def operator_round(close: bool = False) -> None:
        kube = await as_operator(cp, ns, "gx", tmp_path)
        try:
            pods = await kube.list_pods(ns, L.POOL)
            if close:
                await serving_gate.close(kube, ns, pods, chosen)
            else:
                assert await serving_gate.sync(kube, ns, pods) == 1
        finally:
            await kube.close()

    asyncio.run(operator_round())
    assert wait_for(lambda: endpoints(cp, ns, "gx-engines") == [chosen], timeout=30, what="the serving pod's endpoint")
    cp.kubectl("-n", ns, "annotate", "pod", chosen, f"{L.DRAINING}=now")
    asyncio.run(operator_round(close=True))  # a drain starts: out of the Service at once
    assert wait_for(lambda: endpoints(cp, ns, "gx-engines") == [], timeout=30, what="the draining pod gone")
    cp.helm("uninstall", "gx", "-n", ns, "--wait", "--timeout=60s")
    assert token(cp, ns, name) == t  # documented: the operator's Secret stays


def test_namespace_editors_and_viewers_get_kascade_objects(control_plane: ControlPlane, crds: list[str],
                                                          namespace: str) -> None:
    cp, ns = control_plane, namespace
    cp.helm("install", "rb", str(CHART), "-n", ns, "--set", "operator.enabled=false", "--set", "pool.enabled=false",
            "--set", "router.enabled=false", "--set", "tests.enabled=false")
    cp.kubectl("-n", ns, "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice")
    cp.kubectl("-n", ns, "create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob")

    def can(user: str, *what: str, where: str = ns) -> str:
        return cp.kubectl("auth", "can-i", *what, "-n", where, "--as", user, check=False).stdout.strip()

    # the controller-manager's aggregation controller folds the chart's roles into edit and view
    wait_for(lambda: can("alice", "create", "modelservices.kascade.io") == "yes", timeout=30, what="edit aggregated")
    wait_for(lambda: can("bob", "list", "scaleplans.kascade.io") == "yes", timeout=30, what="view aggregated")
    assert can("alice", "delete", "modelserviceroles.kascade.io") == "yes"
    assert can("bob", "create", "modelservices.kascade.io") == "no"
    assert can("alice", "create", "modelservices.kascade.io", where="default") == "no"  # only where bound
    cp.helm("uninstall", "rb", "-n", ns)
