"""Supervised child processes: start with a log file, stop by PID (process group), never leak.

Each component runs in its own session so a stop reaches any children it spawned. Processes started
in this interpreter are also stopped at interpreter exit as a safety net.

A PID alone is not an identity: a state file can outlive a reboot and its PIDs be reused by unrelated
processes. Callers that reattach by PID also pass the kernel start time (`start_time`), and a PID whose
start time differs counts as gone, so it is never signalled. Zombies count as gone too (an orphan is
reaped by init, which may be slow or, in some containers, never happen).

atexit does not run when the interpreter is killed (SIGKILL, or SIGTERM from `timeout`), so children
that must not outlive it are started with `die_with_parent` (Linux PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
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
    started: int | None  # kernel start time (clock ticks since boot), None off Linux


def die_with_parent_preexec() -> None:  # runs in the child between fork and exec
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
          die_with_parent: bool = False) -> Proc:
    """Start `argv` in its own session, output to `log_dir/name.log`.

    `die_with_parent`: the kernel sends SIGTERM when this interpreter dies, however it dies.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    pre = die_with_parent_preexec if die_with_parent and sys.platform == "linux" else None
    with open(log_path, "ab") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **(env or {})}, preexec_fn=pre)
    _started.add(p.pid)
    log.info("started %s pid=%d (log %s)", name, p.pid, log_path)
    return Proc(name, p.pid, log_path, start_time(p.pid))


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22 of stat(5); index 0 here is field 3


def alive(pid: int, started: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when `started` is given, is the process started then."""
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
    fields = _stat(pid)
    if fields is None:
        return True  # no /proc (not Linux): kill(0) is all we know
    if fields[0] in ("Z", "X"):
        # it exited after the waitpid above: if it is our child, reap it now, so that a caller told "not alive"
        # (stop()) leaves no zombie of its own behind (a full check once saw /proc/PID still there)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return started is None or int(fields[19]) == started


def stop(pid: int, timeout: float = 10.0, started: int | None = None) -> None:
    """SIGTERM the process group, SIGKILL after `timeout`; returns once the process is gone.

    With `started`, a PID that now belongs to another process is left alone.
    """
    _started.discard(pid)
    if not alive(pid, started):
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
            if not alive(pid, started):
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
