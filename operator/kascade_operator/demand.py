"""Router demand: requests the front door holds and forwards per ModelService, the metric source that
exists when no engine does (scale from zero), and the rule that scales to and from zero.

Data flow: `RouterDemand.get(ns, name)` -> the router URL's host resolved to every address (the chart
points it at a headless Service: one address per router pod) -> GET <replica>/router/v1/demand on each
(at most once per `max_age_s`, shared by every ModelService's round) -> `aggregate()` (pure: sums over
replicas) -> `Demand` -> `zero_rule()` (pure) together with the policy's
wish, the role's minimum and how long the service has been idle -> (desired, reason, release the last
copy?). Only `replicas.min: 0` ever releases the last copy, and only after `idleReleaseSeconds`
without a request.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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


def aggregate(replicas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every router replica's `models` answer merged into one: held, in-flight and rates add up (each
    replica sees only the requests it proxies); idle is the shortest (a request at any replica counts)."""
    out: dict[str, dict[str, Any]] = {}
    for models in replicas:
        for key, d in models.items():
            if not isinstance(d, dict):
                continue
            m = out.setdefault(key, {"queued": 0, "inFlight": 0, "requestsPerSecond": 0.0, "tokensPerSecond": 0.0,
                                     "idleSeconds": None})
            m["queued"] += int(d.get("queued") or 0)
            m["inFlight"] += int(d.get("inFlight") or 0)
            m["requestsPerSecond"] += float(d.get("requestsPerSecond") or 0)
            m["tokensPerSecond"] += float(d.get("tokensPerSecond") or 0)
            idle = d.get("idleSeconds")
            if isinstance(idle, int | float) and (m["idleSeconds"] is None or idle < m["idleSeconds"]):
                m["idleSeconds"] = float(idle)
    return out


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address the name has (`host:port` each): a headless Service's DNS name lists each router
    pod, so the operator reads all of them, not the one a ClusterIP would pick."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for family, *_, addr in infos:
        ip = str(addr[0])
        hostport = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if hostport not in seen:
            seen.append(hostport)
    return seen


class RouterDemand:
    """Demand per ModelService summed over every router replica behind `url` (its host resolved to all
    addresses each read: replicas come and go)."""

    def __init__(self, url: str, timeout_s: float = 0.5, max_age_s: float = 0.1,
                 resolve: Resolver = resolve_all) -> None:
        u = urlsplit(url.rstrip("/"))
        self.scheme, self.host, self.port = (
            u.scheme or "http",
            u.hostname or "",
            u.port or (443 if u.scheme == "https" else 80),
        )
        self.path = u.path + "/router/v1/demand"
        self.netloc = u.netloc
        self.url = f"{self.scheme}://{u.netloc}{self.path}"
        self.max_age_s = max_age_s
        self.resolve = resolve
        self.replicas = 0  # how many answered at the last read
        self.partial = False  # some replica did not answer: it may hold requests we cannot see
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        self._models: dict[str, Any] | None = None
        self._t = -1e9

    async def _one(self, hostport: str) -> dict[str, Any] | None:
        try:
            r = await self._client.get(f"{self.scheme}://{hostport}{self.path}", headers={"Host": self.host})
            r.raise_for_status()
            return dict(r.json().get("models") or {})
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("router demand from %s (%s) unavailable: %s", hostport, self.url, e)
            return None

    async def _read(self) -> dict[str, Any] | None:
        try:  # TLS names a host, not an address: https reads the one replica the name reaches
            addrs = [self.netloc] if self.scheme == "https" else await self.resolve(self.host, self.port)
        except OSError as e:
            log.warning("router demand: %s does not resolve: %s", self.host, e)
            return None
        got = [m for m in await asyncio.gather(*(self._one(a) for a in addrs)) if m is not None]
        self.replicas, self.partial = len(got), len(got) < len(addrs)
        return aggregate(got) if got else None  # none answered: nothing is decided on router demand

    async def get(self, ns: str, name: str) -> Demand | None:
        """This ModelService's demand, or None when no router can be read (nothing is decided on it)."""
        now = time.monotonic()
        if now - self._t > self.max_age_s:
            self._t = now
            self._models = await self._read()
        if self._models is None:
            return None
        d = self._models.get(f"{ns}/{name}")
        if not isinstance(d, dict):
            d = {}
        try:
            # a replica that did not answer may hold requests: not idle (the last copy is never released
            # on partial information; scaling up on what the others report still happens)
            idle = 0.0 if self.partial else d.get("idleSeconds")
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
            return (
                want,
                (
                    f"router: {demand.queued} request(s) held and {demand.in_flight} in flight with no "
                    f"serving replica: scaling from zero; the first copy loads from a released engine's host copy "
                    f"where one is kept (status.sources kind host), else from spec.model.source"
                ),
                False,
            )
        if lo == 0:
            return 0, None, False  # nothing asks for it: stay at zero (policies alone would keep a copy)
    # without a router nothing could bring it back: min 0 then keeps one copy, as the policies do
    if lo == 0 and current >= 1 and demand is not None and not demand.active and idle_s is not None \
            and idle_s >= idle_release_s:
        return (
            0,
            f"idle for {idle_s:.0f} s (>= idleReleaseSeconds {idle_release_s:g}, min 0): releasing every replica",
            True,
        )
    if lo == 0 and current >= 1 and wish == 0:
        return 1, None, False  # below the policy's lower bound but not idle long enough: keep one copy
    return wish, None, False
