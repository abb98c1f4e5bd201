"""The chart's InferencePool (Gateway API Inference Extension) against the extension's own CRD on the real
API server: the CRD comes from the extension's Go module (`hack/install.sh` fetches it into the Go module
cache; nothing of it is committed here), is installed, and the rendered InferencePools go through a
server-side dry run, so its OpenAPI schema and CEL rules judge them, not a copy of our expectations.
A pool with a value the schema refuses is rejected, naming the field (the check can fail).

Not shown here: a Gateway implementation or an endpoint picker routing through the pool (none runs on
the dev machines).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.requirement import unavailable
from kascade_devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
MODULE = "sigs.k8s.io/gateway-api-inference-extension"


def crd_file() -> Path:
    """The InferencePool CRD of the version hack/install.sh fetches, from the Go module cache (no network)."""
    m = re.search(re.escape(MODULE) + r"@(v[0-9][0-9A-Za-z.+-]*)", (REPO / "hack" / "install.sh").read_text())
    assert m, "hack/install.sh names no gateway-api-inference-extension version"
    env = {**os.environ, "GOFLAGS": "", "GOPROXY": "off"}
    try:
        out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{m.group(1)}"], capture_output=True,
                             text=True, env=env, timeout=120, cwd="/")
    except FileNotFoundError:
        unavailable("no `go` to find the Gateway API Inference Extension module (make install)")
    if out.returncode != 0:
        unavailable(f"{MODULE}@{m.group(1)} is not in the Go module cache (make install fetches it): "
                    f"{out.stdout.strip() or out.stderr.strip()}")
    path = (
        Path(json.loads(out.stdout)["Dir"])
        / "config"
        / "crd"
        / "bases"
        / "inference.networking.k8s.io_inferencepools.yaml"
    )
    assert path.is_file(), path
    return path


def render_pools(cp: ControlPlane, *sets: str) -> list[dict[str, Any]]:
    out = cp.helm(
        "template",
        "rel",
        str(CHART),
        "-n",
        "ns",
        "--api-versions",
        "inference.networking.k8s.io/v1/InferencePool",
        *(a for s in sets for a in ("--set", s)),
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "InferencePool"]


def dry_run(cp: ControlPlane, ns: str, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": ns}}
    return cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)


def test_the_charts_inference_pools_pass_the_extensions_crd_on_the_api_server(control_plane: ControlPlane,
                                                                              namespace: str) -> None:
    cp = control_plane
    crd = crd_file()
    assert yaml.safe_load(crd.read_text())["spec"]["group"] == "inference.networking.k8s.io"
    cp.kubectl("apply", "--server-side", "-f", str(crd))
    name = "inferencepools.inference.networking.k8s.io"
    wait_for(lambda: "True" in cp.kubectl("get", "crd", name, "-o",
                                          "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                                          check=False).stdout, 60, f"CRD {name} established")
    # the served version is the one the chart renders
    served = json.loads(cp.kubectl("get", "crd", name, "-o", "json").stdout)["spec"]["versions"]
    pools = render_pools(cp, "router.inferencePool.pools[0].modelService=chat",
                         "router.inferencePool.pools[0].endpointPicker.name=chat-epp",
                         "router.inferencePool.pools[1].modelService=code",
                         "router.inferencePool.pools[1].name=code-pool",
                         "router.inferencePool.pools[1].endpointPicker.name=code-epp",
                         "router.inferencePool.pools[1].endpointPicker.port=9100",
                         "router.inferencePool.pools[1].endpointPicker.failureMode=FailOpen")
    assert [p["metadata"]["name"] for p in pools] == ["chat", "code-pool"]
    assert {p["apiVersion"] for p in pools} <= {
        f"inference.networking.k8s.io/{v['name']}" for v in served if v["served"]
    }
    for pool in pools:
        r = dry_run(cp, namespace, pool)
        assert r.returncode == 0, f"{pool['metadata']['name']}: {r.stderr}"
        assert "created (server dry run)" in r.stdout, r.stdout

    # the API server really judges: a value outside the CRD's enum is refused, naming the field
    bad = json.loads(json.dumps(pools[0]))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    r = dry_run(cp, namespace, bad)
    assert r.returncode != 0 and "failureMode" in r.stderr, r.stderr
    bad = json.loads(json.dumps(pools[0]))
    bad["spec"]["targetPorts"] = [{"number": 8000 + i} for i in range(9)]  # the CRD allows at most 8
    r = dry_run(cp, namespace, bad)
    assert r.returncode != 0 and "targetPorts" in r.stderr, r.stderr
