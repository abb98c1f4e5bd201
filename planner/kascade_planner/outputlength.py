"""Decode demand from the arrival rate and an output-length estimate from recent history (TokenScale).

Why: the output tokens/s the engines measure lags a burst. Requests that just arrived have produced no output
yet, so a policy sized on measured output tokens/s adds decoders only once their batches are already full.
Every arriving request will generate about as many tokens as the requests that finished recently, so the
decode demand is max(measured output tokens/s, arriving requests/s x estimated output length): the burst
counts as decode demand the moment it arrives, and a measured rate above the projection (long requests
still decoding after arrivals calmed) is never cut.

Data flow: the engines' `kascade_request_generation_tokens` histogram (sum and count of finished requests'
generated tokens) over the rate window, and since the engine started, pooled over a role's instances ->
`OutputLength` (the window's mean, else the lifetime mean: a burst after an idle gap still has an estimate) ->
`decode_demand` with `kascade_requests_arrived` as requests/s -> `DecodeDemand` (tokens/s, and why).
The operator (kascade_operator.metrics.snapshot) and the simulator (kascade_sim.pdpolicy) call the same code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OutputLength:
    """Finished requests' generated tokens and count over the rate window and since the engines started."""

    window_tokens: float = 0.0
    window_requests: float = 0.0
    total_tokens: float = 0.0
    total_requests: float = 0.0

    def __post_init__(self) -> None:
        for name in ("window_tokens", "window_requests", "total_tokens", "total_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def mean(self) -> float | None:
        """Mean output tokens per finished request: over the window when any finished in it (recent history),
        else since the engines started; None before any request finished."""
        if self.window_requests > 0:
            return self.window_tokens / self.window_requests
        if self.total_requests > 0:
            return self.total_tokens / self.total_requests
        return None

    @property
    def source(self) -> str:
        return "window" if self.window_requests > 0 else ("lifetime" if self.total_requests > 0 else "none")

    def __add__(self, o: OutputLength) -> OutputLength:
        """Pooled over instances (a role's engines): tokens and requests add, the mean is the pooled one."""
        return OutputLength(self.window_tokens + o.window_tokens, self.window_requests + o.window_requests,
                            self.total_tokens + o.total_tokens, self.total_requests + o.total_requests)


@dataclass(frozen=True)
class DecodeDemand:
    tokens_per_s: float  # the decode demand the policies size decoders for
    measured_tokens_per_s: float  # output tokens/s the engines generated over the window
    projected_tokens_per_s: float  # arriving requests/s x estimated output length (0 without an estimate)
    requests_per_s: float
    output_len: float | None

    @property
    def metrics(self) -> tuple[tuple[str, float], ...]:
        """The numbers behind it, for a decision's `metrics` (status)."""
        out = (
            ("decodeDemandTokensPerSecond", self.tokens_per_s),
            ("outputTokensPerSecond", self.measured_tokens_per_s),
            ("requestsPerSecond", self.requests_per_s),
        )
        return out if self.output_len is None else (*out, ("outputLengthEstimate", self.output_len))

    @property
    def reason(self) -> str:
        if self.output_len is None:
            return f"{self.tokens_per_s:.0f} output tok/s (no finished request yet: no output-length estimate)"
        return (f"{self.tokens_per_s:.0f} output tok/s = max(measured {self.measured_tokens_per_s:.0f}, "
                f"{self.requests_per_s:.2f} req/s x est. {self.output_len:.1f} output tokens)")


def decode_demand(measured_tokens_per_s: float, requests_per_s: float, output_len: float | None) -> DecodeDemand:
    """max(measured output tokens/s, arriving requests/s x estimated output length)."""
    if measured_tokens_per_s < 0 or requests_per_s < 0 or (output_len is not None and output_len < 0):
        raise ValueError(f"decode demand inputs must be >= 0, got measured={measured_tokens_per_s} "
                         f"requests_per_s={requests_per_s} output_len={output_len}")
    projected = requests_per_s * output_len if output_len is not None else 0.0
    return DecodeDemand(max(measured_tokens_per_s, projected), measured_tokens_per_s, projected, requests_per_s,
                        output_len)
