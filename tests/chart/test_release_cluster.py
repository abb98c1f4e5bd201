"""The chart as a new user meets it, on the real control plane: install with a non-default release name
and an existing token Secret, apply the sample exactly as NOTES says, and the operator (a real process,
authenticated as the chart's ServiceAccount, configured by the Deployment's own environment) creates a
fallback pod that references that Secret; Pod Security `baseline` enforced on the namespace admits the
pool and `helm test` passes through a real router; `helm upgrade` from charts 0.1.0 and 0.2.0 keeps the
generated engine token and upgrades the CRDs by the documented step.

No kubelet runs here (KWOK marks scheduled pods Running). `helm test`'s pod is run by a stand-in
kubelet: its `kascade ...` args run as a local process, the front door Service's URL replaced by a real
`kascade router` process watching the namespace (or, while the chart has no router, the engine process
behind the engines Service), and the exit code becomes the pod's phase, which is
all `helm test` reads.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from kascade_devcluster import processes
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.kubeconfig import kubeconfig_text
from kascade_devcluster.nodes import KWOK_TOLERATION
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.peercerts import make_peer_certs
from kascade_devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
PREVIOUS = (
    Path(__file__).with_name("data") / "kascade-0.1.0.tgz"
)  # `helm package` of the chart at 0.1.0 (and 0.2.0 beside it)


def get(cp: ControlPlane, ns: str, *what: str) -> Any:
    return json.loads(cp.kubectl("-n", ns, "get", *what, "-o", "json").stdout)


def values_file(tmp: Path, values: dict[str, Any]) -> str:
    path = tmp / f"values-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_notes_sample_and_fallback_pod_use_the_release_secret(
        control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]], crds: list[str], namespace: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool (and its token and TLS Secrets) in the release namespace, ModelServices in another, watched
    one: NOTES sends the sample there, and the fallback pod lands next to the Secrets it names."""
    kwok_nodes(2, gpus=2)
    cp = control_plane
    team = f"{namespace}-team"  # the only namespace the operator watches; not the release's
    cp.kubectl("create", "namespace", team)
    cp.kubectl("-n", namespace, "create", "secret", "generic", "team-token", "--from-literal=token=t0k3n")
    values = {"engineToken": {"existingSecret": "team-token"}, "tests": {"enabled": False},
              "dataPlaneTls": {"secretName": "engine-tls"},
              "operator": {"watchNamespaces": [team], "tolerations": [KWOK_TOLERATION],
                           "allowedHostPathRoots": ["/models"]},  # fallback pods mount the sample's path
              "pool": {"replicas": 0}}  # an empty pool: the operator must take the slow path
    out = cp.helm("install", "prod-llm", str(CHART), "-n", namespace, "-f", values_file(tmp_path, values))
    assert not get(cp, namespace, "secrets", "-l", "app.kubernetes.io/instance=prod-llm")[
        "items"
    ]  # existingSecret used

    # NOTES' own command, with the sample URL pointing at this checkout's copy of the same file
    line = next(raw for raw in out.stdout.splitlines() if "kubectl apply" in raw)
    args = shlex.split(line.strip())
    assert args[:4] == ["kubectl", "apply", "-n", team], line
    url = args[args.index("-f") + 1]
    assert url.startswith("https://raw.githubusercontent.com/kascade/kascade/main/"), url
    cp.kubectl(*[str(REPO / url.split("/main/", 1)[1]) if a == url else a for a in args[1:]])

    # the operator as the chart runs it: the Deployment's env, the chart's ServiceAccount and RBAC
    dep = get(cp, namespace, "deployment", "prod-llm-operator")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    downward = {"metadata.namespace": namespace, "metadata.name": "prod-llm-operator-0"}  # what the kubelet fills in
    for e in container["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            monkeypatch.setenv(e["name"], downward[e["valueFrom"]["fieldRef"]["fieldPath"]])
    assert {e["name"]: e.get("value") for e in container["env"]}["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"] == "team-token"
    # dataPlaneTls: engines serve HTTPS and the operator is told the CA file the kubelet projects from the
    # Secret's ca.crt; here the same file made locally (the operator refuses to start without a loadable one)
    assert os.environ["KASCADE_OPERATOR_ENGINE_CA_FILE"].endswith("/ca.crt")
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_CA_FILE", str(make_peer_certs(tmp_path / "pki")["ca"]))
    sa_token = cp.kubectl("-n", namespace, "create", "token", "prod-llm-operator", "--duration=1h").stdout.strip()
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(kubeconfig_text(cp.api_url, cp.ca_cert, sa_token, user="prod-llm-operator"))
    op = OperatorProcess(cast(ControlPlane, SimpleNamespace(kubeconfig=kubeconfig)), team, "t0k3n",
                         tmp_path / "operator.log")
    op.start()
    try:
        pods = wait_for(lambda: get(cp, namespace, "pods", "-l", "kascade.io/pool=warm")["items"], timeout=60,
                        what=f"a fallback pod (operator log: {tmp_path / 'operator.log'})")
    finally:
        op.stop()
    assert "Forbidden" not in op.tail(), op.tail()
    pod = pods[0]
    engine = pod["spec"]["containers"][0]
    ref = next(e for e in engine["env"] if e["name"] == "KASCADE_ENGINE_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "team-token", "key": "token"}
    # the data-plane TLS Secret mounted and used exactly as the chart's pool does
    tls = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert tls["secret"]["secretName"] == "engine-tls"
    mount = next(m for m in engine["volumeMounts"] if m["name"] == tls["name"])
    assert [a for a in engine["args"] if a.startswith("--tls-")] == [
        f"--tls-cert={mount['mountPath']}/tls.crt", f"--tls-key={mount['mountPath']}/tls.key",
        f"--tls-ca={mount['mountPath']}/ca.crt"]
    # what a kubelet needs to start it: the Secret it references exists in the pod's namespace (the pool's)
    assert pod["metadata"]["namespace"] == namespace
    assert pod["metadata"]["annotations"]["kascade.io/created-for"] == f"{team}/smollm2"  # the sample's name
    cp.kubectl("-n", namespace, "get", "secret", ref["name"])
    events = get(cp, team, "events")["items"]
    # the operator said why it took the slow path (an Event on the ModelService, in its namespace)
    assert any(e["involvedObject"]["kind"] == "ModelService" and e["type"] == "Warning" for e in events), \
        [(e["involvedObject"]["kind"], e["reason"]) for e in events]
    cp.kubectl("-n", team, "delete", "msvc", "--all", "--wait=false")
    cp.helm("uninstall", "prod-llm", "-n", namespace)
    cp.kubectl("delete", "namespace", team, "--wait=false")


def _serve_test_pod(cp: ControlPlane, ns: str, pod_name: str, services: dict[str, str], stop: threading.Event,
                    log: list[str]) -> None:
    """Stand-in kubelet for one `helm test` pod: run its args locally (a Service URL replaced by the local
    process standing behind that Service), report the exit code as the pod's phase."""
    while not stop.is_set():
        got = cp.kubectl("-n", ns, "get", "pod", pod_name, "-o", "json", check=False)
        if got.returncode != 0:
            time.sleep(0.2)
            continue
        pod = json.loads(got.stdout)
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            time.sleep(0.2)
            continue
        args = list(pod["spec"]["containers"][0]["args"])
        assert args[0] == "kascade", args
        for i, a in enumerate(args):  # http://<service>.<ns>.svc:<port> -> the process behind the Service
            if a.startswith("http://") and ".svc:" in a:
                host = a.split("//", 1)[1].split(".", 1)[0]
                cp.kubectl("-n", ns, "get", "service", host)  # the chart created the Service it names
                args[i] = f"http://{services.get(host, '127.0.0.1:9')}"
        proc = subprocess.run([sys.executable, "-m", "kascade_cli.main", *args[1:]], capture_output=True, text=True,
                              timeout=90)
        log.append(proc.stdout + proc.stderr)
        phase = "Succeeded" if proc.returncode == 0 else "Failed"
        cp.kubectl("-n", ns, "patch", "pod", pod_name, "--subresource=status", "--type=merge",
                   "-p", json.dumps({"status": {"phase": phase}}))


def _start_router(cp: ControlPlane, ns: str, log_dir: Path) -> tuple[processes.Proc, str]:
    """`kascade router` watching the namespace, as the chart's router Deployment runs it."""
    proc = processes.start("router", [sys.executable, "-m", "kascade_cli.main", "router", "--namespace", ns,
                                      "--host", "127.0.0.1", "--port", "0"], log_dir,
                           env={"KUBECONFIG": str(cp.kubeconfig)}, die_with_parent=True)
    m = wait_for(lambda: re.search(r"KASCADE_ROUTER_READY http=(\d+)", proc.log.read_text(errors="replace")), 60,
                 f"the router ready (log {proc.log})")
    return proc, f"127.0.0.1:{m.group(1)}"


def test_pod_security_baseline_admits_the_pool_and_helm_test_passes(
        control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]], crds: list[str], namespace: str,
        tmp_path: Path) -> None:
    cp = control_plane
    nodes = kwok_nodes(2, gpus=2)
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline",
               "pod-security.kubernetes.io/warn=restricted")
    values = {"pool": {"replicas": 2, "tolerations": [KWOK_TOLERATION], "model": {"name": "tiny-chart"}},
              "operator": {"tolerations": [KWOK_TOLERATION]}, "tests": {"timeoutSeconds": 3}}
    # the front door: the router when the chart has one (it lists the models of the namespace's
    # ModelServices), else the engines Service (a real engine process behind it)
    has_router = (CHART / "templates" / "router-service.yaml").exists()
    if has_router:
        values["router"] = {"enabled": True, "tolerations": [KWOK_TOLERATION]}
    out = cp.helm("install", "edge", str(CHART), "-n", namespace, "-f", values_file(tmp_path, values),
                  "--wait", "--timeout=90s")
    assert "would violate PodSecurity" not in out.stderr, out.stderr  # restricted, not only baseline
    pool = get(cp, namespace, "pods", "-l", "kascade.io/pool=warm,app.kubernetes.io/instance=edge")["items"]
    assert len(pool) == 2 and {p["status"]["phase"] for p in pool} == {"Running"}
    # a pod that baseline forbids is refused here: the enforcement is real
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hostpath"},
           "spec": {"containers": [{"name": "c", "image": "x"}],
                    "volumes": [{"name": "h", "hostPath": {"path": "/models"}}]}}
    refused = cp.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr

    stop, log = threading.Event(), []
    engines = None
    if has_router:
        router, address = _start_router(cp, namespace, tmp_path / "router")
        services = {"edge-router": address}
    else:
        from kascade_engine.weights.checkpoint import tiny_llama

        engines = EnginePool(cp, namespace, tiny_llama(tmp_path / "tiny-chart", layers=1, hidden=32, vocab=128),
                             "tiny-chart", "tok", tmp_path / "engines")
        (e,) = engines.start(nodes[:1])
        cp.kubectl("-n", namespace, "label", "pod", e.name, "app.kubernetes.io/instance=edge",
                   "app.kubernetes.io/component=engine")
        services = {"edge-engines": e.endpoint}
    runner = threading.Thread(target=_serve_test_pod, args=(cp, namespace, "edge-test-models", services, stop, log),
                              daemon=True)
    runner.start()
    try:
        cp.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(
            {"apiVersion": "kascade.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "chat"},
             "spec": {"model": {"name": "tiny-chart", "source": {"path": "/models/smollm2-135m"}},
                      "engine": {"image": "ghcr.io/kascade/kascade-engine:0.1.0"}, "mode": "colocated",
                      "replicas": {"colocated": {"min": 1, "max": 2}}}}))
        result = cp.helm("test", "edge", "-n", namespace, "--timeout=90s", check=False)
        assert result.returncode == 0, (result.stdout, result.stderr, log)
        assert "Phase:          Succeeded" in result.stdout and "ok:" in log[-1] and "tiny-chart" in log[-1]
        # and it can fail: the model gone from the front door, the same test pod reports Failed
        if engines is not None:
            engines.stop(delete_pods=False)
        cp.kubectl("-n", namespace, "delete", "msvc", "chat")
        result = cp.helm("test", "edge", "-n", namespace, "--timeout=90s", check=False)
        assert result.returncode != 0 and "failed" in (result.stdout + result.stderr).lower(), result
    finally:
        stop.set()
        if engines is not None:
            engines.stop()
        else:
            processes.stop(router.pid, started=router.started)
    cp.helm("uninstall", "edge", "-n", namespace)


@pytest.mark.parametrize("previous", ["0.1.0", "0.2.0"])
def test_upgrade_from_previous_chart_keeps_token_and_upgrades_crds(
        control_plane: ControlPlane, kwok_nodes: Callable[..., list[str]], namespace: str, tmp_path: Path,
        previous: str) -> None:
    """0.1.0: CRDs older than today's (the API grew), no router. 0.2.0: the chart just before this one
    (`git show fb4650f:charts/kascade`, packaged)."""
    cp = control_plane
    kwok_nodes(1, gpus=1)
    package = PREVIOUS.with_name(f"kascade-{previous}.tgz")
    with tarfile.open(package) as tar:
        old = yaml.safe_load(tar.extractfile("kascade/Chart.yaml").read())  # type: ignore[union-attr]
    assert old["version"] == previous
    new_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert new_version != old["version"]
    base = {"pool": {"replicas": 1, "tolerations": [KWOK_TOLERATION]}, "operator": {"tolerations": [KWOK_TOLERATION]}}
    # 0.1.0's schema knows no router; later charts run it by default (it must tolerate the KWOK nodes)
    with_router = {**base, "router": {"tolerations": [KWOK_TOLERATION]}}
    values = values_file(tmp_path, base if previous == "0.1.0" else with_router)
    # the chart README's command: keep the release's values, take new keys' defaults from the new chart
    upgrade_args = ["--reset-then-reuse-values"]
    if previous == "0.1.0":
        upgrade_args += ["-f", values_file(tmp_path, {"router": with_router["router"]})]
    # the cluster as the previous chart left it: its CRDs (the session may have installed today's), then its release
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
               input=cp.helm("show", "crds", str(package)).stdout)
    cp.helm("install", "up", str(package), "-n", namespace, "-f", values, "--wait", "--timeout=90s")
    token = get(cp, namespace, "secret", "up-engine-token")["data"]["token"]
    # docs/upgrade.md (0.3.0 -> 0.4.0): keep the Secret the old chart generated; the new operator adopts it
    cp.kubectl("-n", namespace, "annotate", "secret", "up-engine-token", "helm.sh/resource-policy=keep")

    # the documented step (docs/upgrade.md, NOTES): the new chart's CRDs, server-side applied
    crds = cp.helm("show", "crds", str(CHART)).stdout

    def schemas(docs: list[dict[str, Any]]) -> dict[str, list[Any]]:
        return {d["metadata"]["name"]: [v["schema"]["openAPIV3Schema"] for v in d["spec"]["versions"]] for d in docs}

    want = schemas([d for d in yaml.safe_load_all(crds) if d])

    def live() -> dict[str, list[Any]]:
        return schemas([json.loads(cp.kubectl("get", "crd", n, "-o", "json").stdout) for n in want])

    if previous == "0.1.0":  # its CRDs are on the server, and they are not the new ones: a real CRD upgrade
        assert live() != want
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crds)
    cp.helm("upgrade", "up", str(CHART), "-n", namespace, *upgrade_args, "--wait", "--timeout=90s")

    assert get(cp, namespace, "secret", "up-engine-token")["data"]["token"] == token
    rel = json.loads(cp.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["chart"], r["revision"]) for r in rel] == [("up", f"kascade-{new_version}", "2")]
    assert live() == want
    # the upgraded objects: new labels, the operator told the Secret name
    dep = get(cp, namespace, "deployment", "up-operator")
    assert dep["metadata"]["labels"]["app.kubernetes.io/version"]
    assert dep["metadata"]["labels"]["helm.sh/chart"] == f"kascade-{new_version}"
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"] == "up-engine-token"
    assert env["KASCADE_OPERATOR_POOL_NAMESPACE"] == namespace
    assert env["KASCADE_OPERATOR_ROUTER_URL"] == f"http://up-router.{namespace}.svc:8080"  # the front door
    # the pool rolled to the new template and is back at full strength
    pool = get(cp, namespace, "deployment", "up-pool")
    assert pool["metadata"]["labels"]["helm.sh/chart"] == f"kascade-{new_version}"
    assert pool["status"].get("updatedReplicas") == pool["spec"]["replicas"] == 1, pool["status"]
    cp.helm("uninstall", "up", "-n", namespace)


def test_pod_security_admits_fallback_pods_except_hostpath(control_plane: ControlPlane, crds: list[str],
                                                           namespace: str) -> None:
    """The API server's Pod Security admission (`restricted` enforced) judges the pods the operator would
    create: pvc and hf:// sources are admitted (the pool's security context), a hostPath source is refused
    naming hostPath (why the chart's default has no hostPath, and docs say to use pvc or hf://)."""
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    cp = control_plane
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")

    def spec(source: dict[str, Any]) -> ModelServiceSpec:
        return ModelServiceSpec.model_validate({"model": {"name": "m", "source": source},
                                                "engine": {"image": "img:1"}, "mode": "colocated",
                                                "replicas": {"colocated": {"min": 1, "max": 2}}})

    def dry_run(source: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        pod = fallback_pod(spec(source), "svc", "tok", None, tls_secret="engine-tls", run_as_user=1234)
        pod["metadata"]["name"] = "fallback-check"
        return cp.kubectl("-n", namespace, "create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)

    for source in ({"pvc": {"claimName": "models"}}, {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}):
        out = dry_run(source)
        assert out.returncode == 0 and "created" in out.stdout, (source, out.stderr)
    refused = dry_run({"path": "/models/m"})
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr and "hostPath" in refused.stderr, \
        refused.stderr
