"""A fallback engine pod (the operator's slow path, when the warm pool is short) starts its engine as the
pool's engines are started: here, --require-prefill-signature exactly when the installation's pool engines
carry it (the chart sets the operator's setting from router.enabled and router.signPrefillPeers). A round on
the fake kube layer creates the pod; its args are parsed by the real `kascade` CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from fakekube import FakeKube

from kascade_cli.main import cli
from kascade_operator import labels as L
from kascade_operator.engine_client import EngineClient
from kascade_operator.handlers import reconcile_service
from kascade_operator.metrics import Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings

NS = "ns"


def engine_params(args: list[str]) -> dict[str, Any]:
    """`kascade engine serve ...` parsed down to its options, as click does when the container starts."""
    assert args[0] == "kascade", args
    ctx = cli.make_context("kascade", list(args[1:]))
    group: click.Command = cli
    rest = ctx.protected_args + ctx.args
    while isinstance(group, click.Group):
        name, cmd, rest = group.resolve_command(ctx, rest)
        assert cmd is not None, f"unknown command {name}"
        ctx = cmd.make_context(name or "", rest, parent=ctx)
        group, rest = cmd, (ctx.protected_args + ctx.args if isinstance(cmd, click.Group) else [])
    assert ctx.command.name == "serve", args
    return dict(ctx.params)


@pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")
@pytest.mark.parametrize("require", [True, False])
async def test_fallback_pod_requires_prefill_signatures_as_the_pool_does(tmp_path: Path, require: bool) -> None:
    (tmp_path / "m").mkdir()  # click checks that the checkpoint directory exists, as it would in the pod
    settings = OperatorSettings(engine_token="t", engine_image="img:1", allowed_host_path_roots=[str(tmp_path)],
                                engine_require_prefill_signature=require)
    kube = FakeKube()  # an empty warm pool: the round creates a fallback pod
    rt = Runtime(settings, kube, EngineClient("t"), Scraper(), None, OperatorMetrics())
    body = {"metadata": {"name": "svc", "namespace": NS, "uid": "uid-svc", "generation": 1},
            "spec": {"model": {"name": "m", "source": {"path": str(tmp_path / "m")}}, "engine": {"image": "img:1"},
                     "mode": "colocated", "replicas": {"colocated": {"min": 1, "max": 1}}}}
    try:
        await reconcile_service(rt, body, "timer")
    finally:
        await rt.engines.aclose()
    made = [p for p in kube.pods.values() if p["metadata"]["annotations"].get(L.CREATED_FOR)]
    assert len(made) == 1, list(kube.pods)
    args = made[0]["spec"]["containers"][0]["args"]
    assert ("--require-prefill-signature" in args) is require, args
    params = engine_params(args)
    assert params["require_prefill_signature"] is require
    assert params["model_name"] == "m" and params["empty"] is True
