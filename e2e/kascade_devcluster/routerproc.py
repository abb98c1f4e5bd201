"""The router as a real local process (`kascade router`) against a local control plane: what the
chart's router Deployment runs in a cluster, here watching one namespace and listening on loopback.

Data flow: `RouterProcess(cp, namespace, log)` -> `start()` spawns `kascade -v router --namespace ns
--port 0` with the control plane's KUBECONFIG (output appended to `log`, dies with this interpreter) ->
waits for its `KASCADE_ROUTER_READY http=<port>` line -> `url` is the OpenAI base URL clients use.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.processes import die_with_parent_preexec

READY = re.compile(r"KASCADE_ROUTER_READY http=(\d+)")


class RouterProcess:
    def __init__(self, cp: ControlPlane, namespace: str, log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.cp, self.ns, self.log, self.extra_args = cp, namespace, log, extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 60.0) -> RouterProcess:
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kascade_cli.main", "-v", "router", "--namespace",
                                          self.ns, "--host", "127.0.0.1", "--port", "0", *self.extra_args],
                                         env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent_preexec if sys.platform == "linux" else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY.search(self.log.read_bytes()[offset:].decode(errors="replace"))
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"router not ready after {timeout:.0f} s:\n{self.tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, chars: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no router log)"
