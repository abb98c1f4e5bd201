"""Free loopback TCP ports, picked by binding port 0 (the kernel chooses)."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> list[int]:
    """Return `n` distinct free ports on 127.0.0.1 (held open together so they are distinct)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
