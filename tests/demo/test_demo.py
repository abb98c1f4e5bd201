"""`kascade demo` end to end (a shorter burst): what a newcomer's first run must show."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from kascade_demo.scenario import Demo, DemoConfig
from kascade_devcluster.binaries import MissingBinaries, bin_dir
from kascade_devcluster.requirement import unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_demo_scales_up_by_chain_serves_throughout_and_back(tmp_path: Path) -> None:
    try:
        bin_dir()
    except MissingBinaries as e:
        unavailable(str(e))
    text = io.StringIO()
    res = Demo(DemoConfig(out=tmp_path / "demo", burst_s=15, steady_s=3),
               Console(file=text, width=200, soft_wrap=True)).run()
    out = text.getvalue()
    chains = [p for p in res.plans if p["spec"]["algorithm"] == "chain"]
    assert chains and all(p["status"]["phase"] == "Succeeded" for p in res.plans), res.plans
    assert res.max_ready >= 2 and res.final_ready == 1
    assert res.requests_failed == 0 and res.requests_ok > 50
    kinds = [e.kind for e in res.events]
    for k in ("decision", "plan", "flow", "ready", "done", "release"):
        assert k in kinds, (k, kinds)
    assert "$ kubectl get msvc,splan" in out and "Succeeded" in out and "weights flowing" in out
    assert res.plot is not None and res.plot.read_bytes()[:4] == b"\x89PNG"
