"""Workloads: request arrivals with prompt and output lengths.

Data flow: a trace file (Azure LLM 2023 `TIMESTAMP,ContextTokens,GeneratedTokens`, or BurstGPT
`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`) or the synthetic burst
generator -> `Workload` (requests sorted by arrival, times in seconds from the first one) ->
`window()` / `scale_rate()` -> the simulator. Malformed rows raise `TraceError` naming file and line.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path


class TraceError(ValueError):
    """A trace file (or a workload parameter) is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def window(self, start_s: float, length_s: float) -> Workload:
        """Requests arriving in [start, start+length), re-based so the window starts at 0."""
        if start_s < 0 or length_s <= 0:
            raise TraceError(f"window needs start >= 0 and length > 0, got start={start_s} length={length_s}")
        end = start_s + length_s
        reqs = tuple(Request(r.arrival_s - start_s, r.input_tokens, r.output_tokens)
                     for r in self.requests if start_s <= r.arrival_s < end)
        return Workload(f"{self.name}[{start_s:g}+{length_s:g}s]", reqs)

    def scale_rate(self, factor: float) -> Workload:
        """Multiply the request rate by `factor` keeping the temporal pattern: time is compressed by the
        factor (rate(t) -> factor * rate(factor * t)) and, so the span stays the same, the trace is
        replayed `ceil(factor)` times side by side with a fractional last copy thinned evenly."""
        if not factor > 0 or math.isinf(factor):
            raise TraceError(f"rate scale factor must be a finite number > 0, got {factor}")
        span = self.duration_s
        if span <= 0:
            return self
        out: list[Request] = []
        copies = math.ceil(factor)
        for c in range(copies):
            # Each copy covers 1/factor of the span; the last copy only the remainder.
            offset = c * span / factor
            for r in self.requests:
                t = offset + r.arrival_s / factor
                if t <= span:
                    out.append(Request(t, r.input_tokens, r.output_tokens))
        out.sort(key=lambda r: r.arrival_s)
        return Workload(f"{self.name}x{factor:g}", tuple(out))

    def rate_series(self, bucket_s: float = 1.0) -> list[int]:
        """Requests per bucket over the trace (for plots and provisioning)."""
        if not self.requests:
            return []
        n = int(self.requests[-1].arrival_s // bucket_s) + 1
        counts = [0] * n
        for r in self.requests:
            counts[int(r.arrival_s // bucket_s)] += 1
        return counts


def _int_field(path: Path, line: int, name: str, raw: str) -> int:
    try:
        v = int(raw.strip())
    except ValueError:
        raise TraceError(f"{path}:{line}: field {name!r} must be an integer, got {raw!r}") from None
    if v < 0:
        raise TraceError(f"{path}:{line}: field {name!r} must be >= 0, got {v}")
    return v


def _csv_rows(path: Path, header: list[str], exact: bool) -> Iterator[tuple[int, list[str]]]:
    """Non-empty data rows with their line numbers, after checking the header (all of it, or its first
    columns when `exact` is False); a row of another width is an error naming the line."""
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        got = next(reader, None)
        seen = [h.strip() for h in (got or [])]
        if got is None or (seen if exact else seen[: len(header)]) != header:
            raise TraceError(f"{path}:1: expected header {','.join(header)}, got {got!r}")
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise TraceError(f"{path}:{reader.line_num}: expected {len(header)} fields, got {len(row)}")
            yield reader.line_num, row


def _finish(name: str, rows: list[tuple[float, int, int]], path: Path) -> Workload:
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Workload(name, tuple(Request(t - t0, max(1, i), max(1, o)) for t, i, o in rows))


def read_azure(path: str | Path) -> Workload:
    """Azure LLM inference trace 2023 (code or conv)."""
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(p, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], exact=False):
        ts = row[0].strip()
        try:
            # 7 fractional digits: datetime takes at most 6.
            base, _, frac = ts.partition(".")
            t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp() + (float("0." + frac) if frac else 0.0)
        except ValueError:
            raise TraceError(f"{p}:{line}: field 'TIMESTAMP' is not 'YYYY-MM-DD HH:MM:SS.fff', got {ts!r}") from None
        rows.append((t, _int_field(p, line, "ContextTokens", row[1]), _int_field(p, line, "GeneratedTokens", row[2])))
    return _finish(p.stem.replace("AzureLLMInferenceTrace_", "azure-"), rows, p)


BURSTGPT_HEADER = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]


def read_burstgpt(path: str | Path, model: str | None = None) -> Workload:
    """BurstGPT CSV (timestamps in seconds); optionally only one `Model` (e.g. ChatGPT, GPT-4)."""
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(p, BURSTGPT_HEADER, exact=True):
        try:
            t = float(row[0])
        except ValueError:
            raise TraceError(f"{p}:{line}: field 'Timestamp' must be a number, got {row[0]!r}") from None
        if not math.isfinite(t):
            raise TraceError(f"{p}:{line}: field 'Timestamp' must be finite, got {row[0]!r}")
        i = _int_field(p, line, "Request tokens", row[2])
        o = _int_field(p, line, "Response tokens", row[3])
        if model is None or row[1].strip() == model:
            rows.append((t, i, o))
    return _finish(p.stem, rows, p)


def synthetic_bursts(duration_s: float, base_rps: float, burst_rps: float, burst_every_s: float,
                     burst_len_s: float, input_tokens: int = 1024, output_tokens: int = 128,
                     seed: int = 0) -> Workload:
    """Poisson arrivals at `base_rps`, rising to `burst_rps` for `burst_len_s` every `burst_every_s`;
    lengths are exponential around the given means (seeded, deterministic)."""
    if duration_s <= 0 or base_rps < 0 or burst_rps < 0 or burst_every_s <= 0 or burst_len_s < 0:
        raise TraceError("synthetic bursts need duration > 0, rates >= 0, burst_every > 0, burst_len >= 0")
    rng = random.Random(seed)
    peak = max(base_rps, burst_rps)
    if peak == 0:
        raise TraceError("synthetic bursts need a rate > 0")
    out = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)  # thinning: draw at the peak rate, keep with rate(t)/peak
        if t >= duration_s:
            break
        rate = burst_rps if (t % burst_every_s) < burst_len_s else base_rps
        if rng.random() * peak < rate:
            out.append(Request(t, max(1, int(rng.expovariate(1 / input_tokens))),
                               max(1, int(rng.expovariate(1 / output_tokens)))))
    return Workload(f"bursts-seed{seed}", tuple(out))


def load(spec: str) -> Workload:
    """`azure:<path>`, `burstgpt:<path>`, or a path (format sniffed from the header)."""
    kind, sep, rest = spec.partition(":")
    if sep and kind == "azure":
        return read_azure(rest)
    if sep and kind == "burstgpt":
        return read_burstgpt(rest)
    p = Path(spec)
    with p.open() as fh:
        head = fh.readline()
    return read_azure(p) if head.startswith("TIMESTAMP") else read_burstgpt(p)
