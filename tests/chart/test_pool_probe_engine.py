"""An idle pool pod is available to its Deployment (issue 32: idle pool pods were never Ready, so `helm
--wait`, Flux and Argo CD hung or went Degraded): the chart's own pool engine command, run as a real
engine process with a tiny checkpoint, answers the chart's readinessProbe while idle, and still refuses
requests (nothing may route to it: the Services select the operator's serving label instead)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from kascade_devcluster.localengine import start_engine
from kascade_engine.weights.checkpoint import tiny_llama

CHART = Path(__file__).resolve().parents[2] / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]
LOCAL = ("--host", "--port", "--act-port", "--checkpoint", "--log-format")  # where this process runs, not what


def test_idle_engine_passes_the_charts_readiness_probe_and_serves_nothing(helm: Helm, tmp_path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--set", "pool.engine.kvTokens=4096",
                                               "--set", "pool.engine.maxPromptTokens=64").stdout) if d]
    pool = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pool")
    engine = next(c for c in pool["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    args = engine["args"][engine["args"].index("serve") + 1:]
    args = [a for a in args if a.split("=")[0] not in LOCAL]
    assert "--empty" in args and "--kv-tokens=4096" in args  # idle: started with no weights, sized by pool.engine
    ckpt = tiny_llama(tmp_path / "tiny", layers=2, hidden=64, vocab=512)
    e = start_engine([*args, "--host=127.0.0.1", f"--checkpoint={ckpt}"])
    try:
        probe = engine["readinessProbe"]["httpGet"]
        assert httpx.get(e.url + probe["path"]).status_code == 200  # Ready: the Deployment counts it available
        assert httpx.get(e.url + "/readyz").text == "empty"  # the engine itself knows it cannot serve
        model = next(a.split("=", 1)[1] for a in args if a.startswith("--model-name="))
        r = httpx.post(e.url + "/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503  # a request that reached it anyway is refused, never answered wrong
    finally:
        e.stop()
