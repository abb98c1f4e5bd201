"""httppool.py: a client per engine endpoint shares one TLS context. httpx builds one per client otherwise
(verify=True loads the CA bundle each time: 0.83 MB of the C heap per client, measured), and the operator that
bound 1,000 engines at 10,000 nodes held ~0.8 GB of them (bench/reaction.py --scale 10000,1000)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kascade_operator.httppool import HttpPool


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_client_per_endpoint_costs_kilobytes_not_a_ca_bundle_each() -> None:
    pool = HttpPool(5.0)
    pool.get("127.0.0.1:1")  # the first client (and the shared context) before the baseline
    before = _rss_mb()
    clients = [pool.get(f"127.0.0.1:{10000 + i}") for i in range(200)]
    grown = _rss_mb() - before
    assert len({id(c) for c in clients}) == 200 and pool.get("127.0.0.1:10000") is clients[0]
    assert grown < 30, f"200 engine clients took {grown:.0f} MB (a TLS context per client: ~166 MB)"
    asyncio.run(pool.aclose())
