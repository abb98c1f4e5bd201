"""The install and GitOps traps a new user met (issue 32 item 6), each pinned on `helm template`:
identical renders (no generated token), idle pool pods Ready while only serving pods are selected, the
operator PDB, decimal `--set`, CRD-gated monitoring objects, init-container resources, engine memory
limit, aggregated edit/view roles, engine capacity flags, image tags from appVersion, and the documented
uninstall naming every CRD."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kascade_operator import capacity
from kascade_operator.api import EngineCapacity
from kascade_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]
MONITORING_APIS = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor", "--api-versions",
                   "monitoring.coreos.com/v1/PodMonitor", "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]


def render(helm: Helm, *args: str, release: str = "rel") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", release, str(CHART), "-n", "ns", *args).stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, [(d["kind"], d["metadata"]["name"]) for d in found]
    return found[0]


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def env(doc: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(doc, "operator")["env"]}


def test_two_renders_are_identical_and_the_pieces_name_one_token_secret(helm: Helm) -> None:
    """Argo CD renders with `helm template` at every sync: a random token there handed each new pod a
    token the running operator did not know."""
    first = helm("template", "rel", str(CHART), "-n", "ns").stdout
    assert first == helm("template", "rel", str(CHART), "-n", "ns").stdout
    docs = [d for d in yaml.safe_load_all(first) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]  # the operator creates it at runtime
    op = one(docs, "Deployment", "rel-operator")
    e = env(op)
    assert e["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"] == "rel-engine-token"
    assert e["KASCADE_OPERATOR_ENGINE_TOKEN_NAMESPACE"] == "ns" and e["KASCADE_OPERATOR_ENGINE_TOKEN_CREATE"] == "true"
    assert "KASCADE_ENGINE_TOKEN" not in e  # a secretKeyRef to a missing Secret would keep the operator from starting
    engine = container(one(docs, "Deployment", "rel-pool"), "engine")
    ref = next(x for x in engine["env"] if x["name"] == "KASCADE_ENGINE_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "rel-engine-token", "key": "token"}
    token_role = one(docs, "Role", "rel-operator-token")
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} in token_role["rules"]
    # the settings the operator builds from exactly this env agree
    s = OperatorSettings(**{k.removeprefix("KASCADE_OPERATOR_").lower(): v for k, v in e.items()
                            if k in ("KASCADE_OPERATOR_ENGINE_TOKEN_SECRET", "KASCADE_OPERATOR_ENGINE_TOKEN_CREATE",
                                     "KASCADE_OPERATOR_ENGINE_TOKEN_NAMESPACE")})
    assert (s.engine_token_secret, s.engine_token_create, s.engine_token_namespace) == ("rel-engine-token", True, "ns")


def test_given_token_or_own_secret_is_rendered_or_referenced_never_created(helm: Helm) -> None:
    given = render(helm, "--set", "engineToken.value=abc")
    assert one(given, "Secret")["data"]["token"] == "YWJj"
    assert env(one(given, "Deployment", "rel-operator"))["KASCADE_OPERATOR_ENGINE_TOKEN_CREATE"] == "false"
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} not in \
        one(given, "Role", "rel-operator-token")["rules"]
    mine = render(helm, "--set", "engineToken.existingSecret=mine")
    assert not [d for d in mine if d["kind"] == "Secret"]
    assert env(one(mine, "Deployment", "rel-operator"))["KASCADE_OPERATOR_ENGINE_TOKEN_SECRET"] == "mine"
    # a pool with no operator in the release: nobody would create the Secret its engines wait for
    bad = helm("template", "rel", str(CHART), "--set", "operator.enabled=false", check=False)
    assert bad.returncode != 0 and "engineToken" in bad.stderr and "operator.enabled=false" in bad.stderr


def test_idle_pool_pods_count_as_available_but_only_serving_pods_are_selected(helm: Helm) -> None:
    docs = render(helm, "--set", "router.inferencePool.pools[0].modelService=chat",
                  "--set", "router.inferencePool.pools[0].endpointPicker.name=epp",
                  "--api-versions", "inference.networking.k8s.io/v1/InferencePool")
    pool = one(docs, "Deployment", "rel-pool")
    spec = pool["spec"]["template"]["spec"]
    assert "readinessGates" not in spec  # Ready = the probe alone, so an idle healthy engine is available
    assert container(pool, "engine")["readinessProbe"]["httpGet"]["path"] == "/healthz"  # 200 while idle
    svc = one(docs, "Service", "rel-engines")
    assert svc["spec"]["selector"]["kascade.io/serving"] == "true"
    assert pool["spec"]["template"]["metadata"]["labels"].get("kascade.io/serving") is None  # idle: not selected
    ip = one(docs, "InferencePool")
    assert ip["spec"]["selector"]["matchLabels"] == {"kascade.io/model-service": "chat", "kascade.io/serving": "true"}


@pytest.mark.parametrize("args", [(), ("--set", "fullnameOverride=kc")], ids=["release", "fullnameOverride"])
def test_operator_pdb_follows_names_and_replicas(helm: Helm, args: tuple[str, ...]) -> None:
    name = "kc-operator" if args else "rel-operator"
    docs = render(helm, *args)
    assert one(docs, "PodDisruptionBudget", name)["spec"]["minAvailable"] == 1
    single = render(helm, *args, "--set", "operator.replicas=1")
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget" and "operator" in d["metadata"]["name"]]
    bad = helm("template", "rel", str(CHART), *args, "--set", "operator.podDisruptionBudget.minAvailable=2",
               check=False)
    assert bad.returncode != 0 and "block" in bad.stderr


def test_decimals_set_on_the_command_line_are_accepted_and_bounded(helm: Helm) -> None:
    docs = render(helm, "--set", "monitoring.prometheusRule.enabled=true", "--set",
                  "monitoring.prometheusRule.ttftSloSeconds=0.25", "--set", "router.holdTimeoutSeconds=2.5",
                  "--set", "topology.interLeafBandwidthRatio=0.75", "--set", "operator.metrics.intervalSeconds=0.2",
                  *MONITORING_APIS)
    exprs = [r["expr"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert any('_bucket{le=~"0.25(' in e for e in exprs), exprs  # the string "0.25" selects its bucket
    assert "--hold-timeout=2.5" in container(one(docs, "Deployment", "rel-router"), "router")["args"]
    e = env(one(docs, "Deployment", "rel-operator"))
    assert (e["KASCADE_OPERATOR_INTER_LEAF_RATIO"], e["KASCADE_OPERATOR_INTERVAL_SECONDS"]) == ("0.75", "0.2")
    for setting, field in (("topology.interLeafBandwidthRatio=1.5", "topology.interLeafBandwidthRatio"),
                           ("operator.metrics.intervalSeconds=0.01", "operator.metrics.intervalSeconds"),
                           ("router.holdTimeoutSeconds=soon", "holdTimeoutSeconds")):
        bad = helm("template", "rel", str(CHART), "--set", setting, check=False)
        assert bad.returncode != 0 and field in bad.stderr, (setting, bad.stderr)


@pytest.mark.parametrize(("setting", "kind", "api"), [
    ("monitoring.serviceMonitor.enabled=true", "ServiceMonitor", "monitoring.coreos.com/v1/ServiceMonitor"),
    ("monitoring.podMonitor.enabled=true", "PodMonitor", "monitoring.coreos.com/v1/PodMonitor"),
    ("monitoring.prometheusRule.enabled=true", "PrometheusRule", "monitoring.coreos.com/v1/PrometheusRule"),
    (
        "router.inferencePool.pools[0].modelService=chat",
        "InferencePool",
        "inference.networking.k8s.io/v1/InferencePool",
    ),
])
def test_objects_of_other_apis_need_their_crds(helm: Helm, setting: str, kind: str, api: str) -> None:
    extra = ["--set", "router.inferencePool.pools[0].endpointPicker.name=epp"] if kind == "InferencePool" else []
    bad = helm("template", "rel", str(CHART), "--set", setting, *extra, check=False)
    assert bad.returncode != 0
    value = setting.split("=")[0].split("[")[0]
    assert value in bad.stderr and kind in bad.stderr and "--api-versions" in bad.stderr, bad.stderr
    assert [d for d in render(helm, "--set", setting, *extra, "--api-versions", api) if d["kind"] == kind]


def test_download_has_resources_engines_a_memory_limit_and_namespace_users_roles(helm: Helm) -> None:
    docs = render(helm)
    pool = one(docs, "Deployment", "rel-pool")
    dl = container(pool, "model-download")["resources"]
    assert dl["limits"]["memory"] and dl["requests"]["cpu"]
    res = container(pool, "engine")["resources"]
    assert res["limits"]["memory"] == "48Gi" and res["limits"]["nvidia.com/gpu"] == 1
    # fallback pods get the same when their ModelService names none
    assert json.loads(env(one(docs, "Deployment", "rel-operator"))["KASCADE_OPERATOR_ENGINE_RESOURCES"]) == res
    edit, view = one(docs, "ClusterRole", "rel-edit"), one(docs, "ClusterRole", "rel-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "create" in edit["rules"][0]["verbs"] and "modelservices" in edit["rules"][0]["resources"]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view["rules"])
    assert not [
        d for d in render(helm, "--set", "rbac.aggregateToEditView=false") if d["metadata"]["name"] == "rel-edit"
    ]


def test_engine_capacity_reaches_pool_args_annotation_and_fallback_settings(helm: Helm) -> None:
    docs = render(helm, "--set", "pool.engine.kvTokens=131072", "--set", "pool.engine.maxPromptTokens=8192",
                  "--set", "pool.engine.dtype=bfloat16")
    pool = one(docs, "Deployment", "rel-pool")
    args = container(pool, "engine")["args"]
    for flag in ("--kv-tokens=131072", "--max-prompt-tokens=8192", "--max-seqs=64", "--max-batch-tokens=512",
                 "--dtype=bfloat16"):
        assert flag in args, args
    ann = pool["spec"]["template"]["metadata"]["annotations"]["kascade.io/engine-capacity"]
    want = {"kvTokens": 131072, "maxPromptTokens": 8192, "maxSeqs": 64, "maxBatchTokens": 512}
    assert capacity.parse(ann) == want and ann == capacity.annotation(want)  # the operator reads what the chart writes
    e = env(one(docs, "Deployment", "rel-operator"))
    s = OperatorSettings(engine_capacity=json.loads(e["KASCADE_OPERATOR_ENGINE_CAPACITY"]),
                         engine_dtype=e["KASCADE_OPERATOR_ENGINE_DTYPE"])
    assert s.engine_capacity == want and s.engine_dtype == "bfloat16"
    bad = helm("template", "rel", str(CHART), "--set", "pool.engine.maxSeqs=0", check=False)
    assert bad.returncode != 0 and "maxSeqs" in bad.stderr


def test_max_prompt_tokens_defaults_to_the_models_context(helm: Helm) -> None:
    """pool.engine.maxPromptTokens 0 (the default): no flag, so the engine takes its model's context; left out of
    the annotation (a service asking for a number binds only pods started with it) and of the fallback pods' flags."""
    docs = render(helm)
    pool = one(docs, "Deployment", "rel-pool")
    args = container(pool, "engine")["args"]
    assert not [a for a in args if a.startswith("--max-prompt-tokens")] and "--max-seqs=64" in args, args
    ann = pool["spec"]["template"]["metadata"]["annotations"]["kascade.io/engine-capacity"]
    assert capacity.parse(ann) == {"kvTokens": 65536, "maxSeqs": 64, "maxBatchTokens": 512}
    e = env(one(docs, "Deployment", "rel-operator"))
    s = OperatorSettings(engine_capacity=json.loads(e["KASCADE_OPERATOR_ENGINE_CAPACITY"]))
    assert s.engine_capacity == {"kvTokens": 65536, "maxSeqs": 64, "maxBatchTokens": 512}
    assert not capacity.matches(ann, EngineCapacity(max_prompt_tokens=2048))
    assert capacity.matches(ann, EngineCapacity(kv_tokens=65536))


def test_image_tags_default_to_the_app_version(helm: Helm) -> None:
    app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    docs = render(helm)
    assert container(one(docs, "Deployment", "rel-operator"), "operator")["image"].endswith(f"/kascade-operator:{app}")
    assert container(one(docs, "Deployment", "rel-pool"), "engine")["image"].endswith(f"/kascade-engine:{app}")
    pinned = render(helm, "--set", "image.tag=dev", "--set", "pool.image.tag=dev")
    assert container(one(pinned, "Deployment", "rel-pool"), "engine")["image"].endswith(":dev")


def test_documented_uninstall_removes_every_crd_and_says_what_remains() -> None:
    doc = (REPO / "docs" / "upgrade.md").read_text()
    section = doc[doc.index("## Uninstall"):]
    assert "helm show crds ./charts/kascade | kubectl delete -f -" in section  # the chart's own list: all of them
    for f in sorted((CHART / "crds").glob("*.yaml")):
        name = yaml.safe_load(f.read_text())["metadata"]["name"]
        assert name.split(".")[0] in section, name  # each named in "what remains"
    assert re.search(r"kascade\.io/created-by=kascade-operator", section)  # the token Secret the operator made
    install = (REPO / "docs" / "install.md").read_text()
    assert "1 replica, Recreate" not in install
    replicas = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["replicas"]
    assert f"`operator.replicas` = {replicas} by default, RollingUpdate" in install
