"""examples/ (HPA, KEDA, prometheus-adapter, Argo CD, Flux) checked against what they name: the API
server accepts the Kubernetes objects (server-side dry run with Kascade's CRDs), every scale target has a
scale subresource, every metric is one an engine exports (through the adapter's renaming where an HPA
reads it), Argo CD ignores exactly the fields the scale subresources write, the GitOps values pass the
chart's schema, and the argocd-cm patch carries the chart's Lua health checks unchanged. KEDA's and
Argo CD's/Flux's own CRDs are not installed here: their objects are checked field by field instead."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.requirement import unavailable
from kascade_engine.metrics import EngineMetrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def all_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for f in sorted(EXAMPLES.glob("*.yaml")):
        for d in docs(f.name):
            yield f.name, d


def crds_by_kind() -> dict[str, dict[str, Any]]:
    out = {}
    for f in (REPO / "crds").glob("*.yaml"):
        crd = yaml.safe_load(f.read_text())
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def scale_path(crd: dict[str, Any], api_version: str) -> str:
    """The JSON pointer of the scale subresource's spec field for the served `api_version` ('' if none)."""
    group, _, version = api_version.partition("/")
    assert group == crd["spec"]["group"], api_version
    v = next((v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]), None)
    assert v is not None, f"{crd['spec']['names']['kind']} {version} is not served"
    scale = v.get("subresources", {}).get("scale")
    return "/" + scale["specReplicasPath"].lstrip(".").replace(".", "/") if scale else ""


def engine_series() -> set[str]:
    """Every series name a real engine's registry exposes (counters with _total, histograms' _bucket...)."""
    text = generate_latest(EngineMetrics("m").registry).decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


def adapter_metrics(series: set[str]) -> set[str]:
    """The custom metric names examples/prometheus-adapter.yaml serves from these series."""
    out = set()
    for rule in docs("prometheus-adapter.yaml")[0]["rules"]["custom"]:
        m = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert m, rule["seriesQuery"]
        matched = {s for s in series if re.fullmatch(m.group(1), s)}
        assert matched, f"adapter rule {m.group(1)} matches no engine series"
        name = rule.get("name")
        for s in matched:
            out.add(re.sub(name["matches"], name["as"].replace("${1}", r"\1"), s) if name else s)
    return out


def test_scale_targets_have_a_scale_subresource() -> None:
    crds = crds_by_kind()
    targets = [
        (f, d.get("kind"), d["spec"]["scaleTargetRef"]) for f, d in all_docs() if "scaleTargetRef" in d.get("spec", {})
    ]
    assert {k for _, k, _ in targets} == {"HorizontalPodAutoscaler", "ScaledObject"}
    assert {t["kind"] for _, _, t in targets} == {"ModelService", "ModelServiceRole"}
    for f, kind, t in targets:
        assert t["kind"] in crds, f"{f}: {kind} targets unknown kind {t['kind']}"
        assert scale_path(crds[t["kind"]], t["apiVersion"]), f"{f}: {t['kind']} has no scale subresource"


def test_every_metric_in_the_examples_is_one_an_engine_exports() -> None:
    series = engine_series()
    assert "kascade_generation_tokens_total" in series  # the registry is the real one
    served = adapter_metrics(series)
    assert {"kascade_generation_tokens_per_second", "kascade_prompt_tokens_per_second",
            "kascade_num_requests_running"} <= served
    hpa_metrics = {m["pods"]["metric"]["name"] for _, d in all_docs() if d.get("kind") == "HorizontalPodAutoscaler"
                   for m in d["spec"]["metrics"] if m["type"] == "Pods"}
    assert hpa_metrics and hpa_metrics <= served, f"no adapter rule serves {hpa_metrics - served}"
    queries = [
        t["metadata"]["query"] for _, d in all_docs() if d.get("kind") == "ScaledObject" for t in d["spec"]["triggers"]
    ]
    assert len(queries) == 2
    for q in queries:
        names = set(re.findall(r"kascade_\w+", q))
        assert names and names <= series, f"{q}: {names - series} is not exported"


def test_keda_scaled_objects_are_well_formed() -> None:
    objs = docs("keda-scaledobject.yaml")
    for o in objs:
        assert o["apiVersion"] == "keda.sh/v1alpha1" and o["metadata"]["name"] == o["spec"]["scaleTargetRef"]["name"]
        assert 0 <= o["spec"]["minReplicaCount"] <= o["spec"]["maxReplicaCount"]
        for t in o["spec"]["triggers"]:
            assert t["type"] == "prometheus" and set(t["metadata"]) >= {"serverAddress", "query", "threshold"}
            assert all(isinstance(v, str) for v in t["metadata"].values()), "KEDA trigger metadata are strings"
            float(t["metadata"]["threshold"])


def test_argocd_ignores_exactly_what_the_scale_subresources_write() -> None:
    crds = crds_by_kind()
    app = docs("argocd-application.yaml")[0]
    ignored = {(i["kind"], p) for i in app["spec"]["ignoreDifferences"] for p in i["jsonPointers"]}
    written = {(k, scale_path(c, f"{c['spec']['group']}/v1alpha1")) for k, c in crds.items()}
    assert ignored == {w for w in written if w[1]}, "ignoreDifferences must match the scale subresources"
    assert all(i["group"] == "kascade.io" for i in app["spec"]["ignoreDifferences"])
    assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]


def test_argocd_cm_patch_carries_the_charts_lua_checks() -> None:
    data = docs("argocd-cm-health.yaml")[0]["data"]
    for kind, script in (("ModelService", "modelservice-health.lua"), ("ScalePlan", "scaleplan-health.lua")):
        assert data[f"resource.customizations.health.kascade.io_{kind}"] == (CHART / "argocd" / script).read_text()


@pytest.fixture(scope="module")
def helm() -> Helm:
    try:
        binary = bin_dir() / "helm"
    except MissingBinaries as e:
        unavailable(str(e))

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, check=check, timeout=120)

    return run


@pytest.mark.parametrize(("name", "values_of"), [
    ("argocd-application.yaml", lambda ds: ds[0]["spec"]["source"]["helm"]["valuesObject"]),
    ("flux-helmrelease.yaml", lambda ds: next(d for d in ds if d["kind"] == "HelmRelease")["spec"]["values"]),
])
def test_gitops_values_render_with_the_chart(helm: Helm, tmp_path: Path, name: str,
                                             values_of: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
    values = values_of(docs(name))
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    out = helm(
        "template", "kascade", str(CHART), "-n", "kascade", "-f", str(tmp_path / "v.yaml"), *CLUSTER_APIS, check=False
    )
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    pool = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "kascade-pool")
    assert pool["spec"]["replicas"] == values["pool"]["replicas"]
    assert any(d["kind"] == "PodMonitor" for d in rendered)
    # the same values with a typo are refused by the schema, naming the key: the check above can fail
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**values, "pool": {"replicaz": 4}}))
    bad = helm("template", "kascade", str(CHART), "-f", str(tmp_path / "bad.yaml"), check=False)
    assert bad.returncode != 0 and "replicaz" in bad.stderr


@pytest.mark.cluster
def test_kubernetes_objects_pass_a_server_side_dry_run(control_plane: ControlPlane, crds: list[str],
                                                        namespace: str) -> None:
    """The API server (Kascade's CRDs with their CEL rules, autoscaling/v2) accepts the HPA example."""
    out = control_plane.kubectl(
        "-n", namespace, "apply", "--dry-run=server", "-f", str(EXAMPLES / "hpa-colocated.yaml")
    )
    assert out.stdout.count("created (server dry run)") == 2, out.stdout
    # the same ModelService with max < min is refused by the server: the dry run validates
    msvc = docs("hpa-colocated.yaml")[0]
    msvc["spec"]["replicas"]["colocated"] = {"min": 3, "max": 1}
    bad = control_plane.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(msvc),
                                check=False)
    assert bad.returncode != 0 and "replicas" in bad.stderr, bad.stderr


# what Argo CD, Flux and `helm install` see on a cluster running prometheus-operator and the Gateway API
# Inference Extension (the chart renders their objects only then; offline `helm template` is told)
CLUSTER_APIS = [a for api in ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor",
                              "monitoring.coreos.com/v1/PrometheusRule", "inference.networking.k8s.io/v1/InferencePool")
                for a in ("--api-versions", api)]


def docs_values_snippets() -> list[tuple[str, dict[str, Any]]]:
    """```yaml blocks in docs/*.md whose top-level keys are all chart values: they are values files."""
    keys = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    out = []
    for md in sorted((REPO / "docs").glob("*.md")):
        for m in re.finditer(r"```yaml\n(.*?)```", md.read_text(), re.S):
            d = yaml.safe_load(m.group(1))
            if isinstance(d, dict) and d and set(d) <= keys:
                out.append((md.name, d))
    return out


def test_values_snippets_in_the_docs_render_with_the_chart(helm: Helm, tmp_path: Path) -> None:
    snippets = docs_values_snippets()
    assert {f for f, _ in snippets} >= {"install.md", "observability.md"} and len(snippets) >= 3
    for i, (md, values) in enumerate(snippets):
        (tmp_path / f"{i}.yaml").write_text(yaml.safe_dump(values))
        out = helm("template", "kascade", str(CHART), "-n", "kascade", "-f", str(tmp_path / f"{i}.yaml"), *CLUSTER_APIS,
                   check=False)
        assert out.returncode == 0, f"docs/{md}: {values} -> {out.stderr}"


def test_helm_commands_in_the_docs_render(helm: Helm) -> None:
    """Every `helm install|upgrade ... ./charts/kascade ...` line in docs/*.md, run as `helm template` with
    the same flags (a user copies them verbatim; `--set x=true` once made a nodeSelector a boolean)."""
    import shlex

    found = 0
    for md in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", md.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv[:2] not in (["helm", "install"], ["helm", "upgrade"]) or "./charts/kascade" not in argv:
                    continue
                files = [argv[i + 1] for i, a in enumerate(argv) if a in ("-f", "--values")]
                if any(not (REPO / f).exists() for f in files):
                    continue  # the user's own values file
                args = [str(CHART) if a == "./charts/kascade" else a for a in argv[2:]]
                out = helm("template", *args, *CLUSTER_APIS, check=False)
                assert out.returncode == 0, f"docs/{md.name}: {line.strip()} -> {out.stderr}"
                found += 1
    assert found >= 1
