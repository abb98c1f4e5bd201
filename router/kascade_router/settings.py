"""Router settings: limits, timeouts, the routing rule and the engine CA file, one frozen dataclass filled from
CLI flags (`kascade router`, some also from KASCADE_ROUTER_* environment variables there) or tests (the CA
becomes a TLS context in kascade_planner.engine_tls, shared with the operator). Bad values raise a ValueError
naming the setting when the object is made, not on the first request."""

from __future__ import annotations

from dataclasses import dataclass

from kascade_router.balancer import ROUTE_RULES


@dataclass(frozen=True)
class RouterSettings:
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    hold_timeout_s: float = 120.0  # a request for a model with no serving replica waits this long (scale from 0)
    max_queued: int = 256  # held requests per model beyond this get 429
    retry_after_s: int = 5  # Retry-After on 429/503
    connect_timeout_s: float = 2.0  # to an engine; a failure here is retried on another replica
    read_timeout_s: float = 300.0  # longest silence from an engine (headers or between stream chunks)
    attempts: int = 4  # replicas tried per request (only failures before any byte reached the client)
    eject_s: float = 5.0  # an engine that refused a connection is skipped this long (or until its pod changes)
    window_s: float = 10.0  # demand rates are over this window
    # a live (still loading) replica's weight is re-read from its engine this often, not only from its answers
    # (kascade_router.shares); 0: only from its answers
    live_share_refresh_s: float = 0.25
    engine_ca_file: str = ""  # engines serve HTTPS with certificates from this CA (names not checked); "" = HTTP
    # how a backend is picked (kascade_router.balancer): "ttft", the least expected time to first token from
    # this router's measured first tokens ("share" until measured); "share", the least (in flight + 1) / weight
    route: str = "ttft"

    def __post_init__(self) -> None:
        if self.route not in ROUTE_RULES:
            raise ValueError(f"router setting route (--route, KASCADE_ROUTER_ROUTE) must be one of "
                             f"{', '.join(ROUTE_RULES)}, got {self.route!r}")
