"""Router settings: limits, timeouts and engine TLS, one frozen dataclass filled from CLI flags or tests."""

from __future__ import annotations

import ssl
from dataclasses import dataclass


def engine_tls_context(ca_file: str) -> ssl.SSLContext | None:
    """Client context for engines started with TLS files: their certificate must chain to the CA in
    `ca_file`; names are not checked (engines are addressed by pod IP, the CA is the trust boundary, as on
    the data plane). None for "" (plain HTTP). An unreadable or invalid file raises ValueError naming it."""
    if not ca_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"engine CA file {ca_file}: {e}") from None
    return ctx


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
    engine_ca_file: str = ""  # engines serve HTTPS with certificates from this CA (names not checked); "" = HTTP
