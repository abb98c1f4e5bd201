"""The P:D ratio policy (TokenScale): how many prefill and decode instances a disaggregated service needs,
decided together from its token-rate demand and the measured (or typed) velocities.

Data flow: `PdDemand` (prompt tokens/s arriving at the service, and the decode demand: output tokens/s
projected from arrivals x the output length estimated from recent history, kascade_planner.outputlength) + `PdVelocity`
(one
prefiller's prompt tokens/s, the KV link's tokens/s out of it, one decoder's output tokens/s) + each
role's `Bounds` -> `pd_ratio` -> `PdRatio` (desired prefill, desired decode, the reason with numbers).

Why both at once: a prefiller feeds decoders, so the two counts are one throughput split in two. Each
role alone needs demand / velocity instances (prefill at min(prefill, network) velocity: KV must also
leave). When one role is capped by its max, the service serves only that share of the demand, and the
other role is sized for that share, not for the whole demand (decoders with nothing prefilled for
them, or prefillers whose KV no decoder takes, are waste). The ratio P:D then stays the ratio of the
measured velocities, whatever the caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kascade_planner.policies import Bounds


@dataclass(frozen=True)
class PdDemand:
    """Token rates arriving at the service (every request's prompt is counted once, where it arrived)."""

    input_tokens_per_s: float
    output_tokens_per_s: float  # decode demand: kascade_planner.outputlength.decode_demand's tokens/s
    # how the decode demand was reached (max(measured, arrivals x estimated output length)), for the reason
    output_note: str = ""

    def __post_init__(self) -> None:
        if self.input_tokens_per_s < 0 or self.output_tokens_per_s < 0:
            raise ValueError(
                f"token rates must be >= 0, got input={self.input_tokens_per_s} output={self.output_tokens_per_s}"
            )


@dataclass(frozen=True)
class PdVelocity:
    """What one instance sustains: prefill prompt tokens/s, KV link tokens/s out of a prefiller, decode
    output tokens/s. `headroom` > 1 provisions spare capacity."""

    prefill_tokens_per_s: float
    network_tokens_per_s: float
    decode_tokens_per_s: float
    headroom: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "network_tokens_per_s", "decode_tokens_per_s", "headroom"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def prefill_effective(self) -> float:
        """A prefiller's useful rate: its prompt tokens must also leave over the KV link."""
        return min(self.prefill_tokens_per_s, self.network_tokens_per_s)


@dataclass(frozen=True)
class PdRatio:
    prefill: int
    decode: int
    prefill_need: float  # instances the demand asks for, before caps (fractional)
    decode_need: float
    served_fraction: float  # share of the demand the capped counts serve (1.0: all of it)
    reason: str

    @property
    def ratio(self) -> float:
        """Prefillers per decoder (0 with no decoder)."""
        return self.prefill / self.decode if self.decode else 0.0


def _count(need: float, b: Bounds, floor: int) -> int:
    """Whole instances for `need`, within bounds, never below `floor` (0.999... is 1, 1e-9 slack)."""
    return b.clamp(max(floor, math.ceil(need - 1e-9)))


def pd_ratio(d: PdDemand, v: PdVelocity, prefill: Bounds, decode: Bounds) -> PdRatio:
    """Desired prefill and decode counts for `d`. At least one decoder always stays (it is where requests
    arrive and finish; prefill can go to zero when its bounds allow, decoders then prefill themselves)."""
    p_need = d.input_tokens_per_s * v.headroom / v.prefill_effective
    d_need = d.output_tokens_per_s * v.headroom / v.decode_tokens_per_s
    # the share of the demand each role can serve at its max; the service serves the smaller share
    p_share = prefill.max / p_need if p_need > prefill.max else 1.0
    d_share = decode.max / d_need if d_need > decode.max else 1.0
    served = min(p_share, d_share)
    p = _count(p_need * served, prefill, 0)
    dec = _count(d_need * served, decode, 1)
    reason = (
        f"P:D ratio: {d.input_tokens_per_s:.0f} input tok/s / min(prefill {v.prefill_tokens_per_s:.0f}, network "
        f"{v.network_tokens_per_s:.0f}) = {p_need:.2f} prefillers; "
        f"{d.output_note or f'{d.output_tokens_per_s:.0f} output tok/s'} / "
        f"decode {v.decode_tokens_per_s:.0f} = {d_need:.2f} decoders"
    )
    if served < 1.0:
        capped = "prefill" if p_share <= d_share else "decode"
        reason += (
            f"; {capped} capped at max {prefill.max if capped == 'prefill' else decode.max}: "
            f"{served:.0%} of the demand served, the other role sized for that share"
        )
    reason += f" -> {p}P:{dec}D"
    return PdRatio(p, dec, p_need, d_need, served, reason)
