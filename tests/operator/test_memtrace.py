"""memtrace.py: off without KASCADE_MEMTRACE_DUMP; on, the dump names the source line holding the memory;
bad settings are refused naming the variable."""

from __future__ import annotations

import inspect
import time
import tracemalloc
from pathlib import Path

import pytest

from kascade_operator import memtrace


def test_off_unless_asked() -> None:
    assert memtrace.start_from_env({}) is None
    assert not tracemalloc.is_tracing()


def test_the_dump_names_the_line_that_holds_the_memory(tmp_path: Path) -> None:
    out = tmp_path / "mem.log"
    t = memtrace.start_from_env({"KASCADE_MEMTRACE_DUMP": str(out), "KASCADE_MEMTRACE_EVERY_S": "0.05",
                                 "KASCADE_MEMTRACE_TOP": "3"})
    assert t is not None
    try:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        held = [bytes(1000) + bytes([i % 256]) for i in range(20000)]  # ~20 MB, allocated on this line
        deadline = time.monotonic() + 10

        def sizes() -> list[float]:  # MB on that line, per dump so far (a dump may fall while the list grows)
            text = out.read_text() if out.exists() else ""
            return [float(ln.split()[0]) for ln in text.splitlines() if ln.endswith(f"test_memtrace.py:{line}")]

        while not any(mb >= 15 for mb in sizes()):
            assert time.monotonic() < deadline, out.read_text() if out.exists() else "no dump"
            time.sleep(0.05)
        assert len(held) == 20000
    finally:
        t.stop()
    assert not tracemalloc.is_tracing()


@pytest.mark.parametrize("env", [{"KASCADE_MEMTRACE_EVERY_S": "soon"}, {"KASCADE_MEMTRACE_EVERY_S": "0"},
                                 {"KASCADE_MEMTRACE_TOP": "0"}])
def test_bad_settings_name_the_variable(tmp_path: Path, env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="KASCADE_MEMTRACE_"):
        memtrace.start_from_env({"KASCADE_MEMTRACE_DUMP": str(tmp_path / "m"), **env})
    assert not tracemalloc.is_tracing()
