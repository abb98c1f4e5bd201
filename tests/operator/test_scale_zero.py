"""Scale to and from zero (replicas.min 0): the router's demand brings the first replica back, an idle
time releases the last one, and nothing else ever drains the last copy."""

from __future__ import annotations

import pytest
from builders import pod, spec

from kascade_operator.demand import Demand, RouterDemand, aggregate, resolve_all, zero_rule
from kascade_operator.reconcile import CreatePlan, Drain, reconcile


@pytest.mark.parametrize(("current", "lo", "wish", "demand", "idle", "want", "why", "last", "router"), [
    (0, 0, 0, Demand(queued=2), None, 1, "scaling from zero", False, False),  # held requests, no replica: one
    (0, 0, 3, Demand(in_flight=1), None, 3, "scaling from zero", False, False),  # the policy may want more
    (0, 0, 1, Demand(), None, 0, None, False, False),  # no demand: stay at zero (the policy would keep a copy)
    (0, 0, 1, None, None, 1, None, False, False),  # no router: nothing could scale it back up, keep a copy
    (1, 0, 0, None, 999.0, 1, None, False, False),  # no router: never released
    (1, 0, 0, Demand(), 301.0, 0, "idle for 301 s", True, False),  # idle long enough: the last copy goes
    (1, 0, 0, Demand(), 10.0, 1, None, False, False),  # below the policy's bound, not idle long: keep one
    (1, 0, 0, Demand(queued=1), 999.0, 1, None, False, False),  # a held request is never idle
    (1, 1, 0, Demand(), 999.0, 0, None, False, False),  # min 1: the policy's wish, the reconciler keeps the copy
    (2, 0, 2, Demand(), 0.0, 2, None, False, False),
    (0, 0, 1, None, None, 0, None, False, True),  # router configured but not readable yet: stay at zero
    (1, 0, 0, None, 999.0, 1, None, False, True),  # router unreadable: the last copy is never released
])
def test_zero_rule(current: int, lo: int, wish: int, demand: Demand | None, idle: float | None, want: int,
                   why: str | None, last: bool, router: bool) -> None:
    got, reason, release_last = zero_rule(current, lo, wish, demand, idle, 300.0, router)
    assert got == want and release_last == last
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_from_zero_loads_the_first_copy_from_the_source() -> None:
    res = reconcile("svc", spec(lo=0, hi=2), [pod("p-a")], [], {"colocated": 1}, "router demand")
    assert res.actions == (CreatePlan("colocated", (), ("p-a",), "router demand"),)  # no source pod: spec.model.source


def test_last_copy_drains_only_when_released() -> None:
    one = [pod("r1", ms="svc", role="colocated", ready=True)]
    assert reconcile("svc", spec(lo=0, hi=2), one, [], {"colocated": 0}).actions == ()
    res = reconcile("svc", spec(lo=0, hi=2), one, [], {"colocated": 0}, release_last={"colocated"})
    assert res.actions == (Drain("r1"),) and res.available  # desired 0: nothing is missing


def test_scale_subresource_to_zero_releases_the_last_replica() -> None:
    """`kubectl scale modelservice svc --replicas=0` (min 0) is an explicit ask for zero: the last ready copy
    drains too (issue 32: it never did, the round kept one copy as for a policy's wish). A policy's wish of 0
    without the idle release still keeps it."""
    one = [pod("r1", ms="svc", role="colocated", ready=True)]
    res = reconcile("svc", spec(lo=0, hi=2, desired=0), one, [])
    assert res.actions == (Drain("r1"),) and res.available
    pd = [pod("p1", ms="svc", role="prefill", ready=True), pod("d1", ms="svc", role="decode", ready=True)]
    res = reconcile("svc", spec("disaggregated", lo=0, hi=2, desired=0), pd, [])
    assert sorted(res.actions, key=str) == [Drain("d1"), Drain("p1")]
    assert reconcile("svc", spec(lo=0, hi=2), one, [], {"colocated": 0}).actions == ()
    assert reconcile("svc", spec(lo=0, hi=2, desired=1), one, []).actions == ()


# -- demand from every router replica -----------------------------------------------------------------
def test_aggregate_sums_replicas_and_keeps_the_shortest_idle() -> None:
    a = {"ns/svc": {"queued": 2, "inFlight": 1, "requestsPerSecond": 1.5, "tokensPerSecond": 10.0, "idleSeconds": 30.0}}
    b = {"ns/svc": {"queued": 1, "inFlight": 0, "requestsPerSecond": 0.5, "tokensPerSecond": 5.0, "idleSeconds": 4.0},
         "ns/other": {"queued": 0, "inFlight": 3, "idleSeconds": None}, "junk": 7}
    got = aggregate([a, b])
    assert got["ns/svc"] == {"queued": 3, "inFlight": 1, "requestsPerSecond": 2.0, "tokensPerSecond": 15.0,
                             "idleSeconds": 4.0}
    assert got["ns/other"]["inFlight"] == 3 and got["ns/other"]["idleSeconds"] is None and "junk" not in got


async def test_router_demand_is_summed_over_every_replica() -> None:
    """Two real router replicas, each holding one request for a model with no serving replica: the
    operator's reader sees both (a ClusterIP would show it one replica's share); a replica that is gone
    leaves the other's share, and none answering means no decision on router demand."""
    import asyncio

    import aiohttp

    from kascade_router.server import Router, static_routes
    from kascade_router.settings import RouterSettings

    routers = []
    for _ in range(2):
        routes = static_routes([])
        routes.set_service("static", "m", "m")
        routers.append(await Router(RouterSettings(hold_timeout_s=30.0), routes).start())
    addrs = [f"127.0.0.1:{r.port}" for r in routers]

    async def both(host: str, port: int) -> list[str]:
        assert (host, port) == ("router-pods.ns.svc", 8080)
        return list(addrs)

    reader = RouterDemand("http://router-pods.ns.svc:8080", timeout_s=5.0, max_age_s=0.0, resolve=both)
    async with aiohttp.ClientSession() as s:
        held = [asyncio.create_task(s.post(f"http://{a}/v1/completions", json={"model": "m", "prompt": "x"}))
                for a in addrs]
        try:
            for _ in range(200):
                d = await reader.get("static", "m")
                if d is not None and d.queued == 2:
                    break
                await asyncio.sleep(0.02)
            assert d is not None and d.queued == 2 and d.active and reader.replicas == 2
            assert await reader.get("static", "absent") == Demand() and not reader.partial
            held[1].cancel()  # that client gives up; then its replica goes away: the other's share remains
            await asyncio.gather(held[1], return_exceptions=True)
            await routers[1].close()
            for _ in range(200):
                d = await reader.get("static", "m")
                if d is not None and d.queued == 1:
                    break
                await asyncio.sleep(0.02)
            assert d is not None and d.queued == 1 and reader.replicas == 1
            assert reader.partial and d.idle_s == 0.0  # the silent replica might hold requests: never idle
            held[0].cancel()
            await asyncio.gather(held[0], return_exceptions=True)
            await routers[0].close()
            assert await reader.get("static", "m") is None  # no router answers: nothing decided on it
        finally:
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            for r in routers:
                await r.close()
            await reader.aclose()


async def test_resolve_all_lists_every_address() -> None:
    got = await resolve_all("localhost", 8080)
    assert "127.0.0.1:8080" in got and len(got) == len(set(got))
