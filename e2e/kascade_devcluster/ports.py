"""Free loopback TCP ports for test engines, control planes and routers.

Ports are picked BELOW the kernel's ephemeral range and never handed out twice by one process. A port
picked by binding port 0 lies inside the ephemeral range; engines bind their data port only when a plan
arrives, and by then any outgoing connection (the readiness prober's, the router's, the load
generator's) may have taken it as its source port: `load-plan` then failed with "Address already in use".
"""

from __future__ import annotations

import os
import random
import socket

_LOW = 10000
_handed_out: set[int] = set()  # ports this process gave out (bound later, maybe much later)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """Return `n` distinct ports on 127.0.0.1 that are free now, outside the ephemeral range, and not
    returned before by this process."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    high = _ephemeral_low()
    rng = random.Random(os.getpid() ^ len(_handed_out))
    out: list[int] = []
    for _ in range(50 * max(n, 1)):
        if len(out) == n:
            break
        port = rng.randrange(_LOW, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        out.append(port)
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} of {n} free ports in [{_LOW}, {high})")
    return out


def free_port_runs(n: int, width: int) -> list[int]:
    """`n` base ports, each with the `width - 1` ports after it free too (a tensor-parallel engine's rank r
    listens on its data port + r), all outside the ephemeral range and never returned before."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    high = _ephemeral_low()
    rng = random.Random(os.getpid() ^ len(_handed_out) ^ width)
    out: list[int] = []
    for _ in range(50 * max(n, 1)):
        if len(out) == n:
            break
        base = rng.randrange(_LOW, high - width)
        run = range(base, base + width)
        if any(p in _handed_out for p in run):
            continue
        socks = []
        try:
            for p in run:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(run)
        out.append(base)
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} of {n} runs of {width} free ports in [{_LOW}, {high})")
    return out
