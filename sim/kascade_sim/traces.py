"""Trace readers: Azure LLM inference 2023 and BurstGPT CSVs, streamed and bounded.

Data flow: a file -> lines read one at a time (never the whole file: a line longer than
`MAX_LINE_CHARS` is an error, not a buffer) -> strictly parsed fields -> only the rows inside the
requested window are kept -> `Workload`. Every bad input is a one-line `TraceError` naming the file,
the line and the field: a byte-order mark is skipped, not reported as a bad header; timestamps and
token counts must be plain decimals (`03.5e3` is not a number of seconds here, and `.5e3` after a
clock time is not a fraction); token counts are bounded by `MAX_TOKENS`; the trace may span at most
`MAX_SPAN_S` and keep at most `MAX_REQUESTS` requests.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from kascade_sim.workload import Request, TraceError, Workload

MAX_LINE_CHARS = 4096
MAX_TOKENS = 10_000_000
MAX_SPAN_S = 366 * 86400.0  # a year of trace
MAX_REQUESTS = 20_000_000
_INT = re.compile(r"\d{1,30}")
_DECIMAL = re.compile(r"\d{1,15}(\.\d{1,12})?")
_AZURE_TS = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")
AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
BURSTGPT_HEADER = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) one line at a time; a BOM is dropped, an over-long line is an error."""
    try:
        fh = path.open("rb")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    with fh:
        n = 0
        while True:
            n += 1
            raw = fh.readline(MAX_LINE_CHARS + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_CHARS and not raw.endswith(b"\n"):
                raise TraceError(f"{path}:{n}: line longer than {MAX_LINE_CHARS} characters")
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{n}: not UTF-8 text") from None
            yield n, line


def _rows(path: Path, header: list[str], exact: bool) -> Iterator[tuple[int, list[str]]]:
    lines = _lines(path)
    first = next(lines, None)
    got = next(csv.reader([first[1]]), []) if first else []
    seen = [h.strip() for h in got]
    if not first or (seen if exact else seen[: len(header)]) != header:
        shown = first[1].strip()[:120] if first else "an empty file"
        raise TraceError(f"{path}:1: expected header {','.join(header)}, got {shown!r}")
    for n, line in lines:
        if not line.strip():
            continue
        try:
            row = next(csv.reader([line]))
        except csv.Error as e:
            raise TraceError(f"{path}:{n}: malformed CSV: {e}") from None
        if len(row) != len(header):
            raise TraceError(f"{path}:{n}: expected {len(header)} fields, got {len(row)}")
        yield n, row


def _tokens(path: Path, line: int, name: str, raw: str) -> int:
    s = raw.strip()
    if not _INT.fullmatch(s):
        raise TraceError(f"{path}:{line}: field {name!r} must be a non-negative integer, got {s[:40]!r}")
    v = int(s)
    if v > MAX_TOKENS:
        raise TraceError(f"{path}:{line}: field {name!r} = {v} exceeds {MAX_TOKENS} tokens")
    return v


def _azure_time(path: Path, line: int, raw: str) -> float:
    s = raw.strip()
    m = _AZURE_TS.fullmatch(s)
    try:
        if m is None:
            raise ValueError
        base = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise TraceError(f"{path}:{line}: field 'TIMESTAMP' is not 'YYYY-MM-DD HH:MM:SS.fffffff', "
                         f"got {s[:40]!r}") from None
    frac = m.group(2)
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _burst_time(path: Path, line: int, raw: str) -> float:
    s = raw.strip()
    if not _DECIMAL.fullmatch(s):
        raise TraceError(f"{path}:{line}: field 'Timestamp' must be a plain decimal number of seconds, "
                         f"got {s[:40]!r}")
    return float(s)


class _Collector:
    """Keeps only the rows inside [start, start+length) of the trace's own clock (seconds from its
    first row), checking the span and the number of kept rows as it goes."""

    def __init__(self, path: Path, start_s: float, length_s: float | None) -> None:
        if not start_s >= 0 or (length_s is not None and not length_s > 0):
            raise TraceError(f"window needs start >= 0 and length > 0, got start={start_s} length={length_s}")
        self.path, self.start, self.end = path, start_s, (start_s + length_s if length_s is not None else None)
        self.t0: float | None = None
        self.lo = self.hi = 0.0
        self.rows: list[tuple[float, int, int]] = []

    def add(self, line: int, t: float, inp: int, out: int) -> None:
        if self.t0 is None:
            self.t0 = t
        rel = t - self.t0
        self.lo, self.hi = min(self.lo, rel), max(self.hi, rel)
        if self.hi - self.lo > MAX_SPAN_S:
            raise TraceError(f"{self.path}:{line}: the trace spans more than {MAX_SPAN_S / 86400:.0f} days "
                             f"(timestamp {t:.0f})")
        if rel >= self.start and (self.end is None or rel < self.end):
            if len(self.rows) >= MAX_REQUESTS:
                raise TraceError(f"{self.path}:{line}: more than {MAX_REQUESTS} requests in the window")
            self.rows.append((rel - self.start, inp, out))

    def workload(self, name: str) -> Workload:
        if self.t0 is None:
            raise TraceError(f"{self.path}: no requests")
        self.rows.sort(key=lambda r: r[0])
        base = self.rows[0][0] if self.end is None and self.rows else 0.0
        suffix = (
            "" if self.end is None and not self.start else f"[{self.start:g}+{(self.end or self.hi) - self.start:g}s]"
        )
        return Workload(name + suffix, tuple(Request(t - base, max(1, i), max(1, o)) for t, i, o in self.rows))


def read_azure(path: str | Path, start_s: float = 0.0, length_s: float | None = None) -> Workload:
    """Azure LLM inference trace 2023 (code or conv), optionally only a window of it."""
    p = Path(path)
    col = _Collector(p, start_s, length_s)
    for line, row in _rows(p, AZURE_HEADER, exact=False):
        t = _azure_time(p, line, row[0])
        col.add(line, t, _tokens(p, line, "ContextTokens", row[1]), _tokens(p, line, "GeneratedTokens", row[2]))
    return col.workload(p.stem.replace("AzureLLMInferenceTrace_", "azure-"))


def read_burstgpt(path: str | Path, model: str | None = None, start_s: float = 0.0,
                  length_s: float | None = None) -> Workload:
    """BurstGPT CSV (timestamps in seconds); optionally only one `Model` (e.g. ChatGPT, GPT-4)."""
    p = Path(path)
    col = _Collector(p, start_s, length_s)
    for line, row in _rows(p, BURSTGPT_HEADER, exact=True):
        t = _burst_time(p, line, row[0])
        i = _tokens(p, line, "Request tokens", row[2])
        o = _tokens(p, line, "Response tokens", row[3])
        if model is None or row[1].strip() == model:
            col.add(line, t, i, o)
    return col.workload(p.stem)


def load(spec: str, start_s: float = 0.0, length_s: float | None = None) -> Workload:
    """`azure:<path>`, `burstgpt:<path>`, or a path (format sniffed from the header)."""
    kind, sep, rest = spec.partition(":")
    if sep and kind == "azure":
        return read_azure(rest, start_s, length_s)
    if sep and kind == "burstgpt":
        return read_burstgpt(rest, None, start_s, length_s)
    p = Path(spec)
    first = next(_lines(p), (1, ""))[1]
    if first.startswith("TIMESTAMP"):
        return read_azure(p, start_s, length_s)
    return read_burstgpt(p, None, start_s, length_s)
