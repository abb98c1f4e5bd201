"""PrefillDeadline: how long a decode engine waits on a prefill engine before it prefills the prompt itself.

A prefill engine that hangs (SIGSTOPped, wedged, a half-open connection) answered nothing while the decoder
waited the transport's 300 s frame timeout on it (issue 38 defect 4). The deadline for a connection to it and
for each KV frame is instead derived from what is measured of that peer: `RemotePrefill.expected_s` (its queue
of this engine's prompts at its reported pace, never less than its recent prefills' average) times `factor`,
clamped to [`floor_s`, `cap_s`]; with nothing measured yet, `default_s`. A peer that missed its deadline is
suspect for `suspect_for_s`: prompts meant for it are prefilled locally without dialling it.

Pure: `seconds` maps an estimate to a deadline; the caller owns the clock and the connections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PrefillDeadline:
    factor: float = 4.0  # a queue that grows while the prompt waits, a slower step than the last measured one
    floor_s: float = 5.0  # a tiny prompt on an idle peer still gets a scheduler tick and a connect
    cap_s: float = 120.0  # past this a local prefill of any prompt this engine admits is sooner
    default_s: float = 30.0  # nothing measured of the peer yet (its first prompt)
    suspect_for_s: float = 30.0  # how long a peer that missed its deadline gets no prompts from here

    def __post_init__(self) -> None:
        for name in ("factor", "floor_s", "cap_s", "default_s", "suspect_for_s"):
            v = getattr(self, name)
            if not 0 < v < math.inf:
                raise ValueError(f"PrefillDeadline.{name} must be a finite number > 0, got {v!r}")
        if self.floor_s > self.cap_s:
            raise ValueError(f"PrefillDeadline.floor_s ({self.floor_s}) must be <= cap_s ({self.cap_s})")

    def seconds(self, expected_s: float | None) -> float:
        """The deadline for a prompt expected to take `expected_s` at the peer (None: nothing measured)."""
        if expected_s is None:
            return max(self.floor_s, self.default_s)
        return min(self.cap_s, max(self.floor_s, self.factor * expected_s))
