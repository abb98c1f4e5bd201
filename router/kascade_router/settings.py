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
    # the client side's guards (kascade_router.guard): a connection with no complete request headers this long
    # after it opened (or after its last answer) is closed; a body not complete this long after its headers
    # gets 408; beyond max_connections open client connections a new one gets 503 + Retry-After and is closed
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 8192
    # backend health (kascade_router.health): a request with no byte from its engine this long makes the router
    # probe the engine's /readyz (probe_timeout_s): no answer ejects the engine (a hung replica) until a probe
    # answers, and the request, nothing of which reached the client, goes to another replica
    first_byte_s: float = 4.0
    probe_timeout_s: float = 2.0
    # an engine whose connections fail (closed before answering, reset) this many times in a row is ejected for
    # eject_s; a refused connection (nothing listens) ejects it at once
    eject_after_failures: int = 3
    # connections this router opens to one engine at most (under the engine's own cap, 1024); a request finding
    # every replica at its cap waits for a slot like a held request
    max_backend_connections: int = 1000
    # admin endpoints (/metrics, /router/v1/demand, /router/v1/routes) on this port only; None: on the client port
    admin_port: int | None = None
    # client API keys (kascade_router.auth): a file of `KEY [MODEL,...]` lines; "" = no authentication
    api_keys_file: str = ""
    # on SIGTERM (after the pod's preStop delay) the listeners close and requests in flight get this long to
    # finish; the chart sizes terminationGracePeriodSeconds to preStop + this
    drain_s: float = 60.0
    # the engine token: the prefill peers the router names to an engine (X-Kascade-Prefill, -Fallback) carry its
    # signature (X-Kascade-Prefill-Sig), which engines started with --require-prefill-signature demand; "" = none
    engine_token: str = ""

    def __post_init__(self) -> None:
        if self.route not in ROUTE_RULES:
            raise ValueError(f"router setting route (--route, KASCADE_ROUTER_ROUTE) must be one of "
                             f"{', '.join(ROUTE_RULES)}, got {self.route!r}")
        for name in ("header_timeout_s", "body_timeout_s", "first_byte_s", "probe_timeout_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"router setting {name} must be > 0 seconds, got {v!r}")
        for name in ("max_connections", "eject_after_failures", "max_backend_connections"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"router setting {name} must be an integer >= 1, got {v!r}")
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ValueError(f"router setting admin_port must be 0-65535 or None, got {self.admin_port!r}")
