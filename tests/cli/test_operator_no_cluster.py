"""`kascade operator run` with no cluster to talk to (issue 32: a missing kubeconfig printed a traceback
and retried forever): one error line naming the kubeconfig, exit status 1, at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.parametrize("content", [None, "clusters: [\n"], ids=["missing", "unparsable"])
@pytest.mark.parametrize("args", [[], ["--leader-elect"]], ids=["single", "leader-elect"])
def test_no_kubeconfig_is_one_line_and_exit_1(tmp_path: Path, content: str | None, args: list[str]) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    if content is not None:
        kubeconfig.write_text(content)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kascade_cli.main", "operator", "run", "--engine-token", "t", *args],
                         capture_output=True, text=True, timeout=60, env={**env, "KUBECONFIG": str(kubeconfig)})
    assert out.returncode == 1, out
    assert time.monotonic() - t0 < 30  # no retry loop
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(kubeconfig) in lines[0] and "no Kubernetes cluster" in lines[0], lines
