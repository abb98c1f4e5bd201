"""Free loopback TCP ports for processes that are told their port before they start.

Ports come from below the kernel's ephemeral range (`ip_local_port_range`): a port picked now is
bound by its process a second later, and in between any outgoing connection may be given an
ephemeral port — UCX opens many — which made a listener fail with "Device is busy". Production
data ports are fixed and outside that range too. Falls back to kernel-chosen ports (bind to 0)
when the range below is exhausted.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

LOWEST = 10000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """Return `n` distinct ports on 127.0.0.1 that were free just now (held open together so they
    are distinct), outside the ephemeral range where possible."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    high = _ephemeral_low()
    candidates = random.sample(range(LOWEST, high), k=min(high - LOWEST, 50 * n + 50)) if high > LOWEST else []
    with ExitStack() as stack:
        ports: list[int] = []
        for port in candidates:
            if len(ports) == n:
                break
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < n:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports
