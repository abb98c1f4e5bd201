"""The API on the real kube-apiserver: CRDs established, samples accepted, invalid ones rejected with
the field named, printer columns, and the scale subresource."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kascade_devcluster.controlplane import ControlPlane, ToolError

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))


def test_crds_established_with_names(control_plane: ControlPlane, crds: list[str]) -> None:
    assert sorted(crds) == ["modelserviceroles.kascade.io", "modelservices.kascade.io", "scaleplans.kascade.io"]
    out = control_plane.kubectl("api-resources", "--api-group=kascade.io", "-o", "wide").stdout
    assert re.search(r"modelservices\s+msvc\s+kascade.io/v1alpha1\s+true\s+ModelService", out), out
    assert re.search(r"scaleplans\s+splan\s+kascade.io/v1alpha1\s+true\s+ScalePlan", out), out
    assert re.search(r"modelserviceroles\s+msvcrole\s+kascade.io/v1alpha1\s+true\s+ModelServiceRole", out), out
    assert "kascade" in out  # category


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_samples_accepted(control_plane: ControlPlane, crds: list[str], namespace: str, path: Path) -> None:
    control_plane.kubectl("-n", namespace, "apply", "-f", str(path))
    doc = yaml.safe_load(path.read_text())
    got = json.loads(control_plane.kubectl("-n", namespace, "get", doc["kind"].lower(), doc["metadata"]["name"],
                                           "-o", "json").stdout)
    assert got["spec"]["sources" if doc["kind"] == "ScalePlan" else "model"] == doc["spec"][
        "sources" if doc["kind"] == "ScalePlan" else "model"]


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_rejected_naming_field(
    control_plane: ControlPlane, crds: list[str], namespace: str, path: Path
) -> None:
    field = re.search(r"^# expect-field: (\S+)", path.read_text(), re.M).group(1)  # type: ignore[union-attr]
    with pytest.raises(ToolError) as e:
        control_plane.kubectl("-n", namespace, "apply", "-f", str(path))
    assert field in str(e.value), str(e.value)
    doc = yaml.safe_load(path.read_text())
    missing = control_plane.kubectl("-n", namespace, "get", doc["kind"].lower(), doc["metadata"]["name"], check=False)
    assert missing.returncode != 0  # nothing was stored


def test_printer_columns_and_scale_subresource(control_plane: ControlPlane, crds: list[str], namespace: str) -> None:
    control_plane.kubectl("-n", namespace, "apply", "-f", str(REPO / "manifests/samples/modelservice.yaml"))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(REPO / "manifests/samples/scaleplan.yaml"))
    out = control_plane.kubectl("-n", namespace, "get", "msvc,splan").stdout
    header_msvc, header_splan = [ln for ln in out.splitlines() if ln.startswith("NAME")]
    assert header_msvc.split() == ["NAME", "MODEL", "MODE", "POLICY", "DESIRED", "READY", "LOADING", "AVAILABLE", "AGE"]
    assert header_splan.split() == ["NAME", "SERVICE", "ROLE", "ALGORITHM", "PHASE", "TARGETS", "PROGRESS", "AGE"]
    assert re.search(
        r"modelservice.kascade.io/smollm2\s+HuggingFaceTB/SmolLM2-135M-Instruct\s+colocated\s+threshold\s", out
    )
    control_plane.kubectl("-n", namespace, "scale", "msvc/smollm2", "--replicas=3")
    out = control_plane.kubectl("-n", namespace, "get", "msvc").stdout
    assert re.search(r"smollm2\s+HuggingFaceTB/SmolLM2-135M-Instruct\s+colocated\s+threshold\s+3\s", out)  # DESIRED
    spec = json.loads(control_plane.kubectl("-n", namespace, "get", "msvc", "smollm2", "-o", "json").stdout)["spec"]
    assert spec["replicas"]["desired"] == 3
    scale = json.loads(control_plane.kubectl("get", "--raw",
        f"/apis/kascade.io/v1alpha1/namespaces/{namespace}/modelservices/smollm2/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    # The CRD's default and the scale subresource's lower bound hold on the server.
    with pytest.raises(ToolError, match="replicas"):
        control_plane.kubectl("-n", namespace, "scale", "msvc/smollm2", "--replicas=-1")
    # Out of the role's bounds (sample: colocated min 1, max 8): refused, naming the field, spec unchanged.
    with pytest.raises(ToolError, match=r"spec\.replicas\.desired"):
        control_plane.kubectl("-n", namespace, "scale", "msvc/smollm2", "--replicas=9")
    spec = json.loads(control_plane.kubectl("-n", namespace, "get", "msvc", "smollm2", "-o", "json").stdout)["spec"]
    assert spec["replicas"]["desired"] == 3


def test_scaleplan_spec_is_immutable(control_plane: ControlPlane, crds: list[str], namespace: str) -> None:
    control_plane.kubectl("-n", namespace, "apply", "-f", str(REPO / "manifests/samples/scaleplan.yaml"))
    with pytest.raises(ToolError, match="immutable"):
        control_plane.kubectl("-n", namespace, "patch", "splan", "smollm2-up-1", "--type=merge",
                              "-p", json.dumps({"spec": {"algorithm": "star"}}))
