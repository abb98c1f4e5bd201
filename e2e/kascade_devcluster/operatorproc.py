"""The operator as a real local process (`kascade operator run`) against a local control plane: what
the chart's Deployment runs in a cluster, here started, SIGKILLed and restarted by tests and the demo.

Data flow: `OperatorProcess(cp, namespace, token, log)` -> `start()` spawns `kascade -v operator run`
with the control plane's KUBECONFIG (output appended to `log`, dies with this interpreter) ->
`kill()` (SIGKILL, the fault tests) / `stop()` (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.processes import die_with_parent_preexec

KASCADE = [sys.executable, "-m", "kascade_cli.main"]


class OperatorProcess:
    def __init__(self, cp: ControlPlane, namespace: str, engine_token: str, log: Path, interval: float = 0.2,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.cp, self.ns, self.token, self.log = cp, namespace, engine_token, log
        self.interval, self.extra_args = interval, extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([*KASCADE, "-v", "operator", "run", "--namespace", self.ns, "--interval",
                                          str(self.interval), "--engine-token", self.token, *self.extra_args],
                                         env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent_preexec if sys.platform == "linux" else None)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, chars: int = 20000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no operator log)"
