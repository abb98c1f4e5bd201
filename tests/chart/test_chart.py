"""The Helm chart: lint, render, strict values, CRDs equal to crds/, generated manifests up to date."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from images import MONITORS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]


def test_lint_passes(helm: Helm) -> None:
    out = helm("lint", str(CHART), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def render(helm: Helm, *args: str, release: str = "rel", ns: str = "ns") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", release, str(CHART), "-n", ns, *args).stdout) if d]


def by(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_template_renders_every_deployable(helm: Helm) -> None:
    docs = render(helm)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ServiceAccount", "rel-operator"), ("ClusterRole", "rel-operator"), ("ClusterRoleBinding", "rel-operator"),
        ("Role", "rel-operator-token"), ("RoleBinding", "rel-operator-token"),  # the token Secret: the operator's
        ("ClusterRole", "rel-edit"), ("ClusterRole", "rel-view"),  # aggregated into edit/admin and view
        ("Deployment", "rel-operator"), ("Deployment", "rel-pool"), ("Service", "rel-operator-metrics"),
        ("Service", "rel-engines"), ("NetworkPolicy", "rel-engines"), ("NetworkPolicy", "rel-operator"),
        ("Pod", "rel-test-models"), ("PodDisruptionBudget", "rel-operator"),
        # the front door is on by default
        ("ServiceAccount", "rel-router"), ("ClusterRole", "rel-router"), ("ClusterRoleBinding", "rel-router"),
        ("Deployment", "rel-router"), ("Service", "rel-router"), ("Service", "rel-router-pods"),
        ("PodDisruptionBudget", "rel-router"),
        ("Job", "rel-operator-uninstall"),  # helm uninstall's pre-delete hook (tests/chart/test_lifecycle.py)
    ])
    op = by(docs, "Deployment", "rel-operator")
    assert op["spec"]["replicas"] == 2 and "strategy" not in op["spec"]  # HA: leader election, rolling updates
    assert op["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    container = op["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in op["spec"]["template"]["spec"]["volumes"]
    assert container["image"] == "ghcr.io/kascade/kascade-operator:0.1.0"
    pool = by(docs, "Deployment", "rel-pool")
    assert pool["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # an upgrade rolls the pool without a spare GPU (a surge pod would wait for one forever)
    assert pool["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert pool["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/kascade/kascade-engine:0.1.0"
    role = by(docs, "Role", "rel-operator-token")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["rel-engine-token"],
                              "verbs": ["get", "watch"]},
                             {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},  # once, when absent
                             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "resourceNames": ["rel-operator"], "verbs": ["get", "update", "patch"]},
                             {"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"],
                              "resourceNames": ["rel-operator"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]


def test_every_object_and_pod_carries_the_standard_labels(helm: Helm) -> None:
    docs = render(helm, "--set", "commonLabels.team=ml", "--set", "podLabels.cost=gpu")
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kascade", d["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == "rel" and labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["team"] == "ml"
        if d["kind"] == "Deployment":
            pod = d["spec"]["template"]["metadata"]["labels"]
            assert pod["app.kubernetes.io/name"] == "kascade" and pod["cost"] == "gpu"
            # selectors are immutable: exactly what chart 0.1.0 had, so `helm upgrade` can patch them
            assert set(d["spec"]["selector"]["matchLabels"]) <= {"app.kubernetes.io/instance",
                                                                 "app.kubernetes.io/component", "kascade.io/pool"}
            assert d["spec"]["selector"]["matchLabels"].items() <= pod.items()


def test_pool_passes_pod_security_restricted_by_construction(helm: Helm) -> None:
    """No hostPath by default (emptyDir + download), non-root, no privilege escalation, seccomp, no
    capabilities: what Pod Security `restricted` (hence `baseline`) requires of each container."""
    docs = render(helm)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    pods.append(by(docs, "Pod", "rel-test-models")["spec"])
    for spec in pods:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], spec.get("volumes")
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert not c.get("ports") or all("hostPort" not in p for p in c["ports"])
    pool = by(docs, "Deployment", "rel-pool")["spec"]["template"]["spec"]
    assert {"name": "models", "emptyDir": {"sizeLimit": "2Gi"}} in pool["volumes"]
    init = pool["initContainers"][0]
    assert init["args"][:5] == [
        "kascade",
        "--log-format=text",
        "model",
        "download",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ]
    assert "--dest=/models/smollm2-135m" in init["args"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]  # writable for the download


def test_model_path_outside_the_mount_is_refused(helm: Helm) -> None:
    out = helm("template", "rel", str(CHART), "--set", "pool.model.path=/data/m", check=False)
    assert out.returncode != 0 and "pool.model.path" in out.stderr and "/models" in out.stderr


def test_common_values_are_accepted_and_used(helm: Helm, tmp_path: Path) -> None:
    values = {
        "global": {"imageRegistry": "reg.example:5000", "imagePullSecrets": ["g-pull"], "storageClass": "x"},
        "imagePullSecrets": [{"name": "pull"}],
        "podAnnotations": {"a": "1"},
        "operator": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "cpu", "operator": "Exists"}]}]
                    }
                }
            },
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"b": "2"},
        },
        "pool": {
            "priorityClassName": "gpu-high",
            "affinity": {"podAntiAffinity": {}},
            "image": {"digest": "sha256:" + "a" * 64},
        },
        "router": {
            "podAnnotations": {"r": "3"},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
        },
        "logFormat": "json",
    }
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    docs = render(helm, "-f", str(tmp_path / "v.yaml"))
    op = by(docs, "Deployment", "rel-operator")["spec"]["template"]
    pool = by(docs, "Deployment", "rel-pool")["spec"]["template"]
    assert op["metadata"]["annotations"] == {"a": "1", "b": "2"}
    # the pool's own: which model its engines serve (ModelServices of other models never bind them)
    assert pool["metadata"]["annotations"] == {"a": "1", "kascade.io/model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                               "kascade.io/engine-capacity": "kvTokens=65536,maxBatchTokens=512,"
                                                                             "maxSeqs=64"}
    assert op["spec"]["imagePullSecrets"] == [{"name": "g-pull"}, {"name": "pull"}] == pool["spec"]["imagePullSecrets"]
    assert (
        op["spec"]["priorityClassName"] == "system-cluster-critical" and pool["spec"]["priorityClassName"] == "gpu-high"
    )
    assert "nodeAffinity" in op["spec"]["affinity"] and pool["spec"]["affinity"] == {"podAntiAffinity": {}}
    assert op["spec"]["containers"][0]["image"] == "reg.example:5000/ghcr.io/kascade/kascade-operator:0.1.0"
    assert (
        pool["spec"]["containers"][0]["image"] == f"reg.example:5000/ghcr.io/kascade/kascade-engine@sha256:{'a' * 64}"
    )
    assert "--log-format=json" in op["spec"]["containers"][0]["args"]
    assert "--log-format=json" in pool["spec"]["containers"][0]["args"]
    router = by(docs, "Deployment", "rel-router")["spec"]["template"]
    assert router["metadata"]["annotations"] == {"a": "1", "r": "3"}
    assert router["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert router["spec"]["imagePullSecrets"] == op["spec"]["imagePullSecrets"]


def test_watch_namespaces_gets_roles_not_cluster_wide_pod_writes(helm: Helm) -> None:
    docs = render(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    cluster = by(docs, "ClusterRole", "rel-operator")
    assert not [r for r in cluster["rules"] if "pods" in r["resources"] or "kascade.io" in r["apiGroups"]], cluster
    roles = {
        d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator"
    }
    assert sorted(roles) == ["ns", "team-a", "team-b"]  # the watched ones and the pool's (release) namespace
    for role in roles.values():
        pods = next(r for r in role["rules"] if "pods" in r["resources"])
        assert {"create", "patch", "delete"} <= set(pods["verbs"])
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "rel-operator"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ns", "team-a", "team-b"]
    assert all(
        b["subjects"] == [{"kind": "ServiceAccount", "name": "rel-operator", "namespace": "ns"}] for b in bindings
    )
    # all namespaces: one ClusterRole with pod writes, no per-namespace Role
    docs = render(helm)
    assert any(
        "pods" in r["resources"] and "create" in r["verbs"] for r in by(docs, "ClusterRole", "rel-operator")["rules"]
    )
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator"]


def test_one_token_secret_name_everywhere(helm: Helm) -> None:
    """The operator, the pool, its RBAC and the fallback pods it creates all name one Secret."""
    for args, name in (((), "rel-engine-token"), (("--set", "engineToken.existingSecret=mine"), "mine"),
                       (("--set", "fullnameOverride=kc"), "kc-engine-token")):
        docs = render(helm, *args)
        full = "kc" if "fullnameOverride=kc" in args else "rel"
        op = by(docs, "Deployment", f"{full}-operator")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in op["env"]}
        assert env["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"]["value"] == name
        assert "KASCADE_ENGINE_TOKEN" not in env  # read (or created) through the API, never a secretKeyRef
        pool = by(docs, "Deployment", f"{full}-pool")["spec"]["template"]["spec"]["containers"][0]
        assert (
            next(e for e in pool["env"] if e["name"] == "KASCADE_ENGINE_TOKEN")["valueFrom"]["secretKeyRef"]["name"]
            == name
        )
        assert by(docs, "Role", f"{full}-operator-token")["rules"][0]["resourceNames"] == [name]
        assert not [d for d in docs if d["kind"] == "Secret"]  # nothing generated at render (GitOps)


def test_pool_namespace_has_one_source(helm: Helm) -> None:
    """The operator's pool namespace is where this release puts the pool and the token Secret; a
    different operator.poolNamespace with pool.enabled is refused naming both; without a pool it is the
    namespace of a pool-only release, and the operator gets pod rights there too."""
    def pool_ns(docs: list[dict[str, Any]]) -> str:
        env = by(docs, "Deployment", "rel-operator")["spec"]["template"]["spec"]["containers"][0]["env"]
        return str(next(e["value"] for e in env if e["name"] == "KASCADE_OPERATOR_POOL_NAMESPACE"))

    assert pool_ns(render(helm)) == "ns" == pool_ns(render(helm, "--set", "operator.poolNamespace=ns"))
    out = helm("template", "rel", str(CHART), "-n", "ns", "--set", "operator.poolNamespace=gpu", check=False)
    assert out.returncode != 0 and 'operator.poolNamespace "gpu"' in out.stderr and '"ns"' in out.stderr, out.stderr
    docs = render(helm, "--set", "pool.enabled=false", "--set", "operator.poolNamespace=gpu",
                  "--set", "operator.watchNamespaces={team}")
    assert pool_ns(docs) == "gpu"
    roles = sorted(
        d["metadata"]["namespace"] for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-operator"
    )
    assert roles == ["gpu", "ns", "team"]
    assert pool_ns(render(helm, "--set", "pool.enabled=false")) == ""  # each ModelService's own namespace


def test_network_policy_opens_engine_ports_only_to_kascade_pods(helm: Helm) -> None:
    docs = render(helm, "--set", "pool.dataPort=19000")
    eng = by(docs, "NetworkPolicy", "rel-engines")
    assert eng["spec"]["podSelector"] == {"matchExpressions": [{"key": "kascade.io/pool", "operator": "Exists"}]}
    rules = eng["spec"]["ingress"]
    # named ports: fallback pods of a ModelService with its own engine port numbers name them the same
    peer_rule = next(r for r in rules if any(p["port"] == "data" for p in r["ports"]))
    assert [p["port"] for p in peer_rule["ports"]] == ["http", "data", "act"]
    assert peer_rule["from"] == [
        {"podSelector": {"matchExpressions": [{"key": "kascade.io/pool", "operator": "Exists"}]}}
    ]
    assert all(r.get("from") for r in rules), "an ingress rule without `from` would open a port to everyone"
    http_only = [r for r in rules if r is not peer_rule]
    assert all([p["port"] for p in r["ports"]] == ["http"] for r in http_only)
    op = by(docs, "NetworkPolicy", "rel-operator")
    assert [p["port"] for r in op["spec"]["ingress"] for p in r["ports"]] == [9090, 8080]
    assert not [d for d in render(helm, "--set", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def test_pod_monitor_watches_the_namespaces_engine_pods_live_in(helm: Helm) -> None:
    """Engine pods (warm, bound, fallback) live in the pool's namespace; without a pool namespace each
    ModelService's fallback pods live in its own namespace, so the PodMonitor must look there too."""
    on = ("--set", "monitoring.podMonitor.enabled=true", "--api-versions", "monitoring.coreos.com/v1/PodMonitor")

    def selector(*args: str) -> dict[str, Any]:
        return dict(by(render(helm, *on, *args), "PodMonitor", "rel-engines")["spec"]["namespaceSelector"])

    assert selector() == {"matchNames": ["ns"]}
    assert selector("--set", "pool.enabled=false", "--set", "operator.poolNamespace=gpu") == {"matchNames": ["gpu"]}
    assert selector("--set", "pool.enabled=false") == {"any": True}
    assert selector("--set", "pool.enabled=false", "--set", "operator.watchNamespaces={team,ns}") == \
        {"matchNames": ["ns", "team"]}


def test_monitoring_pack_renders_when_enabled(helm: Helm) -> None:
    assert not [d for d in render(helm) if d["kind"] in {"ServiceMonitor", "PodMonitor", "PrometheusRule"}]
    docs = render(
        helm,
        *MONITORS,
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--set",
        "monitoring.grafanaDashboard.enabled=true",
        "--set",
        "monitoring.prometheusRule.scaleUpStuckMinutes=7",
    )
    sm = by(docs, "ServiceMonitor", "rel-operator")
    svc = by(docs, "Service", "rel-operator-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    pm = by(docs, "PodMonitor", "rel-engines")
    relabels = {r["targetLabel"]: r["sourceLabels"][0] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert relabels == {"model_service": "__meta_kubernetes_pod_label_kascade_io_model_service",
                        "role": "__meta_kubernetes_pod_label_kascade_io_role",
                        "pool": "__meta_kubernetes_pod_label_kascade_io_pool"}
    rule = by(docs, "PrometheusRule", "rel")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"KascadeScaleUpStuck", "KascadeWarmPoolExhausted", "KascadeTransferFailures",
                           "KascadeTTFTSLOBurn"}
    assert alerts["KascadeScaleUpStuck"]["expr"].endswith("> 420")
    assert "{{ $labels.model_service }}" in alerts["KascadeTTFTSLOBurn"]["annotations"]["summary"]
    assert r'le=~"0.5(\\.0)?"' in alerts["KascadeTTFTSLOBurn"]["expr"]  # PromQL unescapes to the regex 0.5(\.0)?
    cm = by(docs, "ConfigMap", "rel-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kascade.json"]) == json.loads((CHART / "files/dashboards/kascade.json").read_text())


def test_observability_files_are_generated_from_their_source() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "observability.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_rbac_grants_no_wildcards_or_secret_listing(helm: Helm) -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART)).stdout) if d]
    for d in docs:
        for rule in d.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            if "secrets" in rule["resources"]:  # `create` cannot be limited to a name; nothing lists or reads others
                assert d["kind"] == "Role" and (rule.get("resourceNames") or rule["verbs"] == ["create"]), rule


@pytest.mark.parametrize(
    ("setting", "field"),
    [("pool.replicas=-1", "replicas"), ("pool.gpuCount=2", "gpuCount"), ("operator.metrics.source=push", "source"),
     ("topology.interLeafBandwidthRatio=0", "interLeafBandwidthRatio"), ("podAnotations.a=b", "podAnotations"),
     ("operator.affinty.x=y", "affinty"), ("imagePullSecret[0]=x", "imagePullSecret"), ("logFormat=xml", "logFormat"),
     ("pool.model.download.repo=not a repo", "repo"), ("monitoring.podMonitor.interval=5", "interval"),
     ("networkPolicy.enable=true", "enable"), ("global=1", "global"), ("dataPlaneTls.secret=t", "secret"),
     ("dataPlaneTls.secretName=Engine_TLS", "secretName"), ("router.route=fastest", "route")],
)
def test_values_schema_rejects_bad_values_naming_them(helm: Helm, setting: str, field: str) -> None:
    out = helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert out.returncode != 0
    assert field in out.stderr, out.stderr


def test_existing_secret_suppresses_generated_one(helm: Helm) -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--set",
                                                "engineToken.existingSecret=mine").stdout) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]
    op = next(d for d in docs if d["metadata"]["name"] == "rel-operator" and d["kind"] == "Deployment")
    env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"]["value"] == "mine"
    assert env["KASCADE_OPERATOR_ENGINE_TOKEN_CREATE"]["value"] == "false"  # the user's Secret: waited for, never made


def test_chart_crds_equal_source_and_manifests_current(helm: Helm) -> None:
    for src in sorted((REPO / "crds").glob("*.yaml")):
        assert (CHART / "crds" / src.name).read_text() == src.read_text(), f"{src.name} differs: run make manifests"
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "crds").glob("*.yaml")
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "sync_manifests.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_sync_check_names_the_stale_file(tmp_path: Path) -> None:
    """`--check` can fail: on a copy of the repo with one chart CRD edited, it exits 1 naming that file,
    and a plain run restores it."""
    for d in ("crds", "charts", "manifests", "hack"):
        shutil.copytree(REPO / d, tmp_path / d)
    stale = tmp_path / "charts" / "kascade" / "crds" / "kascade.io_scaleplans.yaml"
    stale.write_text(stale.read_text().replace("shortNames: [splan]", "shortNames: [sp]"))
    script = tmp_path / "hack" / "sync_manifests.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "charts/kascade/crds/kascade.io_scaleplans.yaml" in proc.stderr
    assert "modelservices" not in proc.stderr
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True)
    assert stale.read_text() == (REPO / "crds" / "kascade.io_scaleplans.yaml").read_text()


def test_shards_need_a_pool_per_namespace_and_get_the_lease_rights_they_use(helm: Helm) -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        render(helm, "--set", "operator.shards=2")  # one pool for every service: one shard must own it
    assert "operator.shards 2 needs a pool per namespace" in str(e.value.stderr)
    docs = render(helm, "--set", "operator.shards=2", "--set", "pool.enabled=false")
    env = {x["name"]: x.get("value") for x in
           by(docs, "Deployment", "rel-operator")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KASCADE_OPERATOR_SHARDS"] == "2" and env["KASCADE_OPERATOR_LEADER_ELECTION"] == "true"
    rules = by(docs, "Role", "rel-operator-token")["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "verbs": ["get", "list", "update", "patch", "delete"]} in rules  # shard and member Leases, listed by label
    one = by(render(helm), "Role", "rel-operator-token")["rules"]  # one shard: only the leader's Lease, by name
    assert not any("list" in r["verbs"] for r in one if r["resources"] == ["leases"])
