"""The Helm chart: lint, render, strict values, CRDs equal to crds/, generated manifests up to date."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]


def test_lint_passes(helm: Helm) -> None:
    out = helm("lint", str(CHART), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_template_renders_every_deployable(helm: Helm) -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-n", "ns").stdout) if d]
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ServiceAccount", "rel-operator"), ("ClusterRole", "rel-operator"), ("ClusterRoleBinding", "rel-operator"),
        ("Role", "rel-operator-token"), ("RoleBinding", "rel-operator-token"), ("Secret", "rel-engine-token"),
        ("Deployment", "rel-operator"), ("Deployment", "rel-pool"),
    ])
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-operator")
    assert op["spec"]["strategy"] == {"type": "Recreate"}
    assert op["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    container = op["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in op["spec"]["template"]["spec"]["volumes"]
    pool = next(d for d in docs if d["metadata"]["name"] == "rel-pool")
    assert pool["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["rel-engine-token"],
                              "verbs": ["get", "watch"]}]


def test_rbac_grants_no_wildcards_or_secret_listing(helm: Helm) -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART)).stdout) if d]
    for d in docs:
        for rule in d.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            if "secrets" in rule["resources"]:
                assert d["kind"] == "Role" and rule.get("resourceNames"), rule


@pytest.mark.parametrize(
    ("setting", "field"),
    [("pool.replicas=-1", "replicas"), ("pool.gpuCount=2", "gpuCount"), ("operator.metrics.source=push", "source"),
     ("topology.interLeafBandwidthRatio=0", "interLeafBandwidthRatio")],
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
    assert env["KASCADE_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_chart_crds_equal_source_and_manifests_current(helm: Helm) -> None:
    for src in sorted((REPO / "crds").glob("*.yaml")):
        assert (CHART / "crds" / src.name).read_text() == src.read_text(), f"{src.name} differs: run make manifests"
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "sync_manifests.py"), "--check"], capture_output=True, text=True)
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
