"""The operator as a real local process (`kascade operator run`) against a local control plane: what
the chart's Deployment runs in a cluster, here started, SIGKILLed and restarted by tests and the demo.

Data flow: `OperatorProcess(cp, namespace, token, log)` -> `start()` spawns `kascade -v operator run`
with the control plane's KUBECONFIG (output appended to `log`, dies with this interpreter) and returns once
the process answers its liveness endpoint (leading or standby) or has exited -> `kill()` (SIGKILL, the fault
tests) / `stop()` (SIGTERM, then SIGKILL).

Why `start()` waits: on a loaded 2-core machine importing the CLI and the operator took 45 s of wall time
(1.5 s of CPU); a test whose 30 s wait began at spawn timed out on the operator's start-up, not on what it
tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.ports import free_ports
from kascade_devcluster.processes import die_with_parent_preexec

KASCADE = [sys.executable, "-m", "kascade_cli.main"]
STARTUP_TIMEOUT_S = 180.0  # imports under heavy load; a healthy start is ~2 s on an idle machine


class OperatorProcess:
    def __init__(self, cp: ControlPlane, namespace: str, engine_token: str, log: Path, interval: float = 0.2,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, nice: int = 0) -> None:
        """`env`: more environment for the process (a benchmark runs another source tree's operator through
        PYTHONPATH, or a profiler). `nice`: its scheduling niceness (negative: more CPU weight, root only; a
        benchmark gives it the share its pod's CPU request would on a node it shares)."""
        self.cp, self.ns, self.token, self.log = cp, namespace, engine_token, log
        self.interval, self.extra_args, self.env, self.nice = interval, extra_args, env or {}, nice
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> OperatorProcess:
        """Spawn the operator; with `wait`, return once it answers its liveness endpoint or has exited."""
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig), **self.env}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        args = list(self.extra_args)
        if "--liveness" in args:
            liveness = args[args.index("--liveness") + 1]
        else:
            liveness = f"http://127.0.0.1:{free_ports(1)[0]}/healthz"
            args += ["--liveness", liveness]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([*KASCADE, "-v", "operator", "run", "--namespace", self.ns, "--interval",
                                          str(self.interval), "--engine-token", self.token, *args],
                                         env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=self._preexec if sys.platform == "linux" else None)
        if wait:
            self._wait_alive(liveness.replace("0.0.0.0", "127.0.0.1"))
        return self

    def _preexec(self) -> None:
        die_with_parent_preexec()
        if self.nice:
            os.nice(self.nice)  # every thread the operator starts inherits it

    def _wait_alive(self, url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.running and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answered: alive, whatever the status
            except OSError:
                time.sleep(0.1)
        if self.running:
            raise TimeoutError(
                f"operator did not answer {url} within {STARTUP_TIMEOUT_S:.0f} s; log:\n{self.tail(4000)}"
            )

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
