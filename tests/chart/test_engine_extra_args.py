"""pool.extraArgs: further `kascade engine serve` flags of the pool's engines and of the operator's fallback
pods. What the chart renders is parsed by the real CLI; the operator's rendered environment builds its real
settings, and a fallback pod built from them is parsed the same way. Flags the chart or the operator set
from a value of their own are refused, by name, in both places."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kascade_operator.api import ModelServiceSpec
from kascade_operator.podtemplate import fallback_pod
from kascade_operator.settings import ENGINE_MANAGED_FLAGS, OperatorSettings

from .test_chart_commands import CHART, Helm, _deployment, _operator_settings, _render, parse

pytestmark = pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")


def _model(tmp_path: Path) -> tuple[dict[str, Any], ModelServiceSpec]:
    (tmp_path / "m1").mkdir(exist_ok=True)  # click checks the checkpoint directory exists, as in the pod
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path), "download": {"enabled": False}}
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": str(tmp_path / "m1")}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    return model, spec


def test_extra_args_reach_pool_engines_and_fallback_pods(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = _model(tmp_path)
    for extra, mbps, waiting in (([], None, 65536),
                                 (["--transfer-max-mbps=40", "--max-waiting-tokens=1000"], 40.0, 1000)):
        docs = _render(helm, tmp_path, {"pool": {"model": model, "extraArgs": extra}})
        args = _deployment(docs, "rel-pool")["args"]
        own = args[:len(args) - len(extra)]
        assert args[len(own):] == extra and "--model-name=m1" in own  # after the chart's own flags
        got = parse(args)
        assert (got["transfer_max_mbps"], got["max_waiting_tokens"]) == (mbps, waiting)
        settings = _operator_settings(docs, monkeypatch)
        assert settings.engine_extra_args == extra
        fb = parse(fallback_pod(spec, "svc", "tok", None, extra_args=settings.engine_extra_args)
                   ["spec"]["containers"][0]["args"])
        assert (fb["transfer_max_mbps"], fb["max_waiting_tokens"]) == (mbps, waiting)


def test_managed_flags_are_refused_by_name(helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag the pool Deployment or a fallback pod renders (with TLS and prefill signatures on, so all
    of them show) is in the refused list; each refused flag fails the render naming pool.extraArgs and the
    value to set instead, and fails the operator's settings naming its variable."""
    model, spec = _model(tmp_path)
    docs = _render(helm, tmp_path, {"pool": {"model": model}, "dataPlaneTls": {"secretName": "engine-tls"},
                                    "router": {"signPrefillPeers": True}})
    fb = fallback_pod(spec, "svc", "tok", None, tls_secret="engine-tls", installation_capacity={"kvTokens": 8})
    args = [*_deployment(docs, "rel-pool")["args"], *fb["spec"]["containers"][0]["args"]]
    rendered = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert rendered - {"--log-format"} <= ENGINE_MANAGED_FLAGS, rendered - ENGINE_MANAGED_FLAGS
    for flag in sorted(ENGINE_MANAGED_FLAGS):
        out = helm("template", "rel", str(CHART), "--set-json", f'pool.extraArgs=["{flag}=1"]', check=False)
        want = f"pool.extraArgs[0]: {flag} is set by the chart ("
        assert out.returncode != 0 and want in out.stderr, (flag, out.stderr)
        monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_EXTRA_ARGS", json.dumps([f"{flag}=1"]))
        with pytest.raises(ValidationError, match=f"KASCADE_OPERATOR_ENGINE_EXTRA_ARGS\\[0\\]: {flag} is set"):
            OperatorSettings()


@pytest.mark.parametrize("bad", ["40", "-v", "--Transfer=1", "--transfer-max-mbps 40"])
def test_malformed_extra_args_are_refused(helm: Helm, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One item per flag, its value after '=': a bare value or a space-separated pair is refused (a value
    could otherwise pass for a flag and slip past the refused list)."""
    out = helm("template", "rel", str(CHART), "--set-json", f"pool.extraArgs={json.dumps(['--max-n=2', bad])}",
               check=False)
    assert out.returncode != 0 and "extraArgs" in out.stderr, out.stderr
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_EXTRA_ARGS", json.dumps([bad]))
    with pytest.raises(ValidationError, match="KASCADE_OPERATOR_ENGINE_EXTRA_ARGS"):
        OperatorSettings()
