"""The client TLS context for an engine's HTTP port, shared by both ends that call engines (the operator's
control calls and scrapes, the router's proxied requests).

Engines started with TLS files serve HTTPS with a certificate from the installation's CA. They are
addressed by pod IP, so names are not checked: the CA is the trust boundary, as on the data plane
(kascade_engine.net.transport_tls). Data flow: a CA file path (a setting) -> `engine_tls_context` -> an
`ssl.SSLContext` the HTTP client uses, or None for plain HTTP.
"""

from __future__ import annotations

import ssl


def engine_tls_context(ca_file: str) -> ssl.SSLContext | None:
    """Verify engines against the CA in `ca_file` (TLS 1.2+, names not checked); None for "" (plain HTTP).
    An unreadable or invalid file raises ValueError naming it."""
    if not ca_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # engines are pod IPs: the CA is the trust boundary
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"engine CA file {ca_file}: {e}") from None
    return ctx
