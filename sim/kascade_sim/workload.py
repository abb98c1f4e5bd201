"""Workloads: request arrivals with prompt and output lengths, for one model or several.

Data flow: a trace reader (`traces`) or a generator (`generators`) -> `Workload` (requests sorted by
arrival, times in seconds from the first one, each naming its model by index) -> `window()` /
`scale_rate()` / `for_models()` -> the simulator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class TraceError(ValueError):
    """A trace file (or a workload parameter) is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    model: int = 0  # index of the model (service) the request is for


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def models(self) -> int:
        return max((r.model for r in self.requests), default=0) + 1

    def window(self, start_s: float, length_s: float) -> Workload:
        """Requests arriving in [start, start+length), re-based so the window starts at 0."""
        if not (start_s >= 0 and length_s > 0) or math.isinf(start_s):
            raise TraceError(f"window needs start >= 0 and length > 0, got start={start_s} length={length_s}")
        end = start_s + length_s
        reqs = tuple(Request(r.arrival_s - start_s, r.input_tokens, r.output_tokens, r.model)
                     for r in self.requests if start_s <= r.arrival_s < end)
        return Workload(f"{self.name}[{start_s:g}+{length_s:g}s]", reqs)

    def scale_rate(self, factor: float) -> Workload:
        """Multiply the request rate by `factor` keeping the temporal pattern: time is compressed by the
        factor (rate(t) -> factor * rate(factor * t)) and, so the span stays the same, the trace is
        replayed `ceil(factor)` times side by side with a fractional last copy thinned evenly."""
        if not factor > 0 or math.isinf(factor):
            raise TraceError(f"rate scale factor must be a finite number > 0, got {factor}")
        if factor > 1000:
            raise TraceError(f"rate scale factor must be <= 1000, got {factor}")
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
                    out.append(Request(t, r.input_tokens, r.output_tokens, r.model))
        out.sort(key=lambda r: r.arrival_s)
        return Workload(f"{self.name}x{factor:g}", tuple(out))

    def thin(self, keep: float, seed: int = 0) -> Workload:
        """Keep each request with probability `keep` (seeded, independent per request): a lower rate with the
        trace's own timing, bursts and lengths (unlike `scale_rate`, which compresses or stretches time)."""
        if not 0 < keep <= 1:
            raise TraceError(f"thinning keeps a fraction in (0, 1], got {keep}")
        if keep == 1:
            return self
        rng = random.Random(seed)
        return Workload(f"{self.name}-thin{keep:g}", tuple(r for r in self.requests if rng.random() < keep))

    def for_models(self, n: int) -> Workload:
        """The same trace for `n` models, model k's copy shifted by k/n of the span (circularly), so
        the models' bursts do not coincide; each model sees the whole trace."""
        if n < 1 or n > 1024:
            raise TraceError(f"number of models must be in 1..1024, got {n}")
        if n == 1:
            return self
        span = self.duration_s + 1e-9
        out = [Request((r.arrival_s + k * span / n) % span, r.input_tokens, r.output_tokens, k)
               for k in range(n) for r in self.requests]
        out.sort(key=lambda r: (r.arrival_s, r.model))
        return Workload(f"{self.name}-{n}models", tuple(out))

    def for_models_zipf(self, n: int, exponent: float = 1.0, seed: int = 0) -> Workload:
        """Map the trace to `n` models of Zipf popularity, the way lambdaScale maps Azure Functions to models (each
        function a model, a few popular, most rarely invoked): model k replays the trace shifted by k/n of the span
        (its bursts do not coincide with the others') and keeps each request with probability (k+1)^-exponent
        (seeded), so model 0 sees the whole trace and model k about 1/(k+1)^exponent of it."""
        if n < 1 or n > 1024:
            raise TraceError(f"number of models must be in 1..1024, got {n}")
        if not 0 <= exponent <= 8:
            raise TraceError(f"zipf exponent must be in [0, 8], got {exponent}")
        rng = random.Random(seed)
        span = self.duration_s + 1e-9
        out = [Request((r.arrival_s + k * span / n) % span, r.input_tokens, r.output_tokens, k)
               for k in range(n) for r in self.requests if rng.random() < (k + 1) ** -exponent]
        out.sort(key=lambda r: (r.arrival_s, r.model))
        return Workload(f"{self.name}-{n}models-zipf{exponent:g}", tuple(out))

    def rate_series(self, bucket_s: float = 1.0) -> list[int]:
        """Requests per bucket over the trace (for plots and provisioning)."""
        if not self.requests:
            return []
        n = int(self.requests[-1].arrival_s // bucket_s) + 1
        counts = [0] * n
        for r in self.requests:
            counts[int(r.arrival_s // bucket_s)] += 1
        return counts
