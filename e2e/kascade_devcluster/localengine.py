"""A real engine process on this machine, for tests and benchmarks: `kascade engine serve` on free ports,
ready once it prints its KASCADE_ENGINE_READY line.

Data flow: `start_engine(args)` -> `python -m kascade_cli.main engine serve --port 0 --act-port 0 <args>`
with the control token in its environment -> its stdout's READY line (`http=<port> act=<port>`) ->
`EngineProc` (the process, both ports, the token, the CA when started with TLS) -> `stop()`.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class EngineProc:
    proc: subprocess.Popen[str]
    http: int
    act: int
    token: str
    tls_ca: Path | None = None  # started with TLS files: its HTTP port serves HTTPS with a certificate from this CA

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://127.0.0.1:{self.http}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """httpx's `verify=` for this engine: its CA, names unchecked (as the operator and the router)."""
        if self.tls_ca is None:
            return True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(cafile=str(self.tls_ca))
        return ctx

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_engine(args: list[str], token: str = "test-token", timeout: float = 120,
                 cwd: Path | None = None) -> EngineProc:
    """An engine serving with `args` (checkpoint, model name, limits...), once both its ports listen.
    `cwd` is the process's working directory (and so its sys.path[0]); None inherits this one."""
    env = {**os.environ, "KASCADE_ENGINE_TOKEN": token}
    cmd = [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--port", "0", "--act-port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=None if cwd is None else str(cwd))
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited with {proc.wait()}")
        if line.startswith("KASCADE_ENGINE_READY"):
            parts = dict(p.split("=") for p in line.split()[1:])
            ca = args[args.index("--tls-ca") + 1] if "--tls-ca" in args else None
            return EngineProc(proc, int(parts["http"]), int(parts["act"]), token, Path(ca) if ca else None)
    proc.kill()
    raise RuntimeError("engine did not become ready")
