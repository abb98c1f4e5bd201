"""The transport factory: `make_transport(name)` picks a `Transport` by its setting name (`TRANSPORTS`): tcp,
tcp with mutual TLS, or ucx. Its own module so the transports import `transport` (the protocol and framing)
and nothing imports back in a circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kascade_engine.net.transport import TRANSPORTS, TrafficClass, Transport

if TYPE_CHECKING:
    from kascade_engine.net.transport_tls import TlsFiles


def make_transport(name: str, tls: TlsFiles | None = None, mark: TrafficClass | None = None) -> Transport:
    """The transport called `name`; with `tls`, TCP is mutual TLS (`transport_tls`). UCX has no TLS of
    its own (docs/architecture.md says what it protects): asking for both is an error, not a silent downgrade.
    `mark`: the DSCP class of every TCP socket it opens or accepts (None: unmarked; UCX ignores it)."""
    if name == "tcp":
        if tls is not None:
            from kascade_engine.net.transport_tls import TlsTransport

            return TlsTransport(tls, mark)
        from kascade_engine.net.transport_tcp import TcpTransport

        return TcpTransport(mark)
    if name == "ucx":
        if tls is not None:
            raise ValueError("TLS (--tls-*) applies to the tcp transport only; ucx does not encrypt")
        from kascade_engine.net.transport_ucx import UcxTransport

        return UcxTransport()
    raise ValueError(f"unknown transport {name!r} (choose {' or '.join(TRANSPORTS)})")
