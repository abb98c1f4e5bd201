"""Router demand: requests the front door holds and forwards per ModelService, the metric source that
exists when no engine does (scale from zero), and the rule that scales to and from zero.

Data flow: `RouterDemand.get(ns, name)` -> GET <router>/router/v1/demand (at most once per `max_age_s`,
shared by every ModelService's round) -> `Demand` -> `zero_rule()` (pure) together with the policy's
wish, the role's minimum and how long the service has been idle -> (desired, reason, release the last
copy?). Only `replicas.min: 0` ever releases the last copy, and only after `idleReleaseSeconds`
without a request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Demand:
    queued: int = 0  # held by the router: no serving replica
    in_flight: int = 0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    idle_s: float | None = None  # since the router last saw a request (None: never)

    @property
    def active(self) -> bool:
        return self.queued > 0 or self.in_flight > 0


class RouterDemand:
    def __init__(self, url: str, timeout_s: float = 0.5, max_age_s: float = 0.1) -> None:
        self.url = url.rstrip("/") + "/router/v1/demand"
        self.max_age_s = max_age_s
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        self._models: dict[str, Any] | None = None
        self._t = -1e9

    async def get(self, ns: str, name: str) -> Demand | None:
        """This ModelService's demand, or None when the router cannot be read (nothing is decided on it)."""
        now = time.monotonic()
        if now - self._t > self.max_age_s:
            self._t = now
            try:
                r = await self._client.get(self.url)
                r.raise_for_status()
                self._models = dict(r.json().get("models") or {})
            except (httpx.HTTPError, ValueError) as e:
                log.warning("router demand from %s unavailable: %s", self.url, e)
                self._models = None
        if self._models is None:
            return None
        d = self._models.get(f"{ns}/{name}")
        if not isinstance(d, dict):
            return Demand()
        try:
            idle = d.get("idleSeconds")
            return Demand(int(d.get("queued") or 0), int(d.get("inFlight") or 0),
                          float(d.get("requestsPerSecond") or 0), float(d.get("tokensPerSecond") or 0),
                          float(idle) if isinstance(idle, int | float) else None)
        except (TypeError, ValueError):
            log.warning("router demand for %s/%s malformed: %r", ns, name, d)
            return None

    async def aclose(self) -> None:
        await self._client.aclose()


def zero_rule(current: int, lo: int, wish: int, demand: Demand | None, idle_s: float | None,
              idle_release_s: float, router: bool = False) -> tuple[int, str | None, bool]:
    """(desired, reason when it overrides the policy, may the last copy go).

    From zero: requests held or in flight at the router make one replica (or the policy's wish); with
    min 0 and no demand it stays at zero. To zero: only with min 0, a readable router (the way back),
    nothing held or in flight, and no request for `idle_release_s`. `router`: a router is configured;
    `demand` None then means it cannot be read right now (starting, restarting), not that none exists."""
    if current == 0 and lo == 0 and demand is None and router:
        # at zero with a router that cannot be read yet: nothing is known to ask for a copy, and a
        # guess here would load a replica nobody asked for on every operator or router restart
        return 0, None, False
    if current == 0 and demand is not None:
        if demand.active or demand.requests_per_s > 0:
            want = max(1, wish)
            return want, (f"router: {demand.queued} request(s) held and {demand.in_flight} in flight with no "
                          f"serving replica: scaling from zero; the first copy loads from spec.model.source (no "
                          f"host memory tier yet)"), False
        if lo == 0:
            return 0, None, False  # nothing asks for it: stay at zero (policies alone would keep a copy)
    # without a router nothing could bring it back: min 0 then keeps one copy, as the policies do
    if lo == 0 and current >= 1 and demand is not None and not demand.active and idle_s is not None \
            and idle_s >= idle_release_s:
        return 0, f"idle for {idle_s:.0f} s (>= idleReleaseSeconds {idle_release_s:g}, min 0): releasing every replica", True
    if lo == 0 and current >= 1 and wish == 0:
        return 1, None, False  # below the policy's lower bound but not idle long enough: keep one copy
    return wish, None, False
