"""`kascade demo-kind` without a cluster: the release it installs and the ModelService it applies agree, so
the service binds the pool's engines; the pool's engines pace their weight sends (pool.extraArgs) as the
demo says. The run itself needs kind and Docker (make demo-kind; docs/kind.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kascade_demo.kind import KIND_MODEL, KindDemo
from kascade_demo.kindcluster import CACHE
from kascade_demo.scenario import DemoConfig
from kascade_devcluster.requirement import unavailable
from kascade_operator.api import ModelServiceSpec


def test_demo_kind_modelservice_binds_the_pool_it_installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    helm = CACHE / "bin" / "current" / "helm"
    if not helm.exists():
        unavailable(f"{helm} not built (make install)")
    monkeypatch.delenv("KASCADE_KIND_OPERATOR_IMAGE", raising=False)
    monkeypatch.delenv("KASCADE_KIND_ENGINE_IMAGE", raising=False)
    demo = KindDemo(DemoConfig(out=tmp_path))
    out = subprocess.run([str(helm), "template", "kascade", *demo.chart_args("kascade-demo-worker")],
                         capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    pool = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kascade-pool")
    pod = pool["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    ms = ModelServiceSpec.model_validate(demo.modelservice("/ignored")["spec"])
    assert f"--model-name={ms.model.name}" in engine["args"]
    assert f"--checkpoint={ms.model.source.path}" in engine["args"]
    assert engine["image"] == ms.engine.image == demo.engine_image
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "kascade-demo-worker"}
    assert engine["args"][-1] == f"--transfer-max-mbps={KIND_MODEL.transfer_mbps:g}"  # pool.extraArgs, last
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kascade-operator")
    assert op["spec"]["template"]["spec"]["containers"][0]["image"] == demo.operator_image
