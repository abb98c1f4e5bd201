"""Where the operator's memory is: an opt-in tracemalloc dump, for diagnosing RSS at fleet scale.

Off unless `KASCADE_MEMTRACE_DUMP` names a file. Then tracemalloc starts (one frame per allocation: the cost is
CPU and its own bookkeeping memory, so never in a measured run) and every `KASCADE_MEMTRACE_EVERY_S` seconds
(default 60) the file is appended with the process RSS, the traced total, and the top source lines by bytes
still allocated (`KASCADE_MEMTRACE_TOP`, default 25). A daemon thread writes it, so a busy event loop does
not delay the dumps.

Data flow: operator start (handlers.startup) -> `start_from_env(os.environ)` -> thread -> snapshot -> file.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident set (MB), from /proc; NaN where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def dump(path: Path, top: int) -> None:
    """Append one report: RSS, traced bytes, the `top` lines holding the most."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    stats = snap.statistics("lineno")
    total = sum(s.size for s in stats)
    lines = [f"--- {time.strftime('%H:%M:%S')} rss {rss_mb():.0f} MB traced {total / 2**20:.0f} MB"]
    lines += [f"{s.size / 2**20:8.1f} MB {s.count:9d} {s.traceback[0].filename}:{s.traceback[0].lineno}"
              for s in stats[:top]]
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


class Tracing:
    """The running dump thread; `stop()` ends it and tracemalloc (tests; the operator traces until it exits)."""

    def __init__(self, path: Path, every_s: float, top: int) -> None:
        self.path, self.every_s, self.top = path, every_s, top
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kascade-memtrace", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                dump(self.path, self.top)
            except Exception:
                log.exception("memtrace: dump to %s failed", self.path)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()
        tracemalloc.stop()


def start_from_env(env: Mapping[str, str]) -> Tracing | None:
    """Start tracing and the dump thread when KASCADE_MEMTRACE_DUMP is set; None otherwise."""
    target = env.get("KASCADE_MEMTRACE_DUMP")
    if not target:
        return None
    try:
        every, top = float(env.get("KASCADE_MEMTRACE_EVERY_S", "60")), int(env.get("KASCADE_MEMTRACE_TOP", "25"))
    except ValueError as e:
        raise ValueError(f"KASCADE_MEMTRACE_EVERY_S / KASCADE_MEMTRACE_TOP: not a number ({e})") from None
    if every <= 0 or top < 1:
        raise ValueError(f"KASCADE_MEMTRACE_EVERY_S must be > 0 and KASCADE_MEMTRACE_TOP >= 1 (got {every}, {top})")
    tracemalloc.start(1)
    t = Tracing(Path(target), every, top)
    t.thread.start()
    log.warning("memtrace: tracemalloc on, top %d lines every %.0f s to %s (diagnostics only)", top, every, target)
    return t
