"""Supervised child processes: start with a log file, stop by PID (process group), never leak.

Each component runs in its own session so a stop reaches any children it spawned. Processes started
in this interpreter are also stopped at interpreter exit as a safety net.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
_started: set[int] = set()


@dataclass(frozen=True)
class Proc:
    name: str
    pid: int
    log: Path


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **(env or {})})
    _started.add(p.pid)
    log.info("started %s pid=%d (log %s)", name, p.pid, log_path)
    return Proc(name, p.pid, log_path)


def alive(pid: int) -> bool:
    try:
        # Reap if it is our child and already exited, so a zombie does not look alive.
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after `timeout`; returns once the process is gone."""
    _started.discard(pid)
    if not alive(pid):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.05)
    raise RuntimeError(f"process {pid} survived SIGKILL")


def detach(pid: int) -> None:
    """Let `pid` outlive this interpreter (e.g. `kascade cluster up`); stop it later by PID."""
    _started.discard(pid)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@atexit.register
def _stop_all() -> None:
    for pid in list(_started):
        with contextlib.suppress(Exception):
            stop(pid, timeout=3.0)
