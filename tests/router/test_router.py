"""The router in-process: a real aiohttp router in front of real HTTP stub engines on loopback (the
engine's wire format, no model: here the router is what is tested; tests/e2e use real engines)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from kascade_devcluster.stubengine import StubEngine
from kascade_router import backends as B
from kascade_router.backends import Backend, Routes, pod_backend
from kascade_router.balancer import pick
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


def pod(name: str, addr: str, *, svc: str = "svc", ready: bool = True, ns: str = "ns", **ann: str) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "labels": {B.MODEL_SERVICE: svc},
                         "annotations": {B.ENDPOINT: addr, **{k.replace("_", "/", 1): v for k, v in ann.items()}}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


LOADED = {"kascade.io_loaded": "true"}


# -- pure parts -----------------------------------------------------------------------------------------
def test_label_keys_match_the_operator() -> None:
    from kascade_operator import labels as L

    assert (B.MODEL_SERVICE, B.ENDPOINT, B.LOADED, B.LIVE, B.DRAINING, B.UNHEALTHY, B.SERVING_GATE) == \
        (L.MODEL_SERVICE, L.ENDPOINT, L.LOADED, L.LIVE, L.DRAINING, L.UNHEALTHY, L.SERVING_GATE)


@pytest.mark.parametrize(("ann", "ready", "weight"), [
    ({"kascade.io_loaded": "true"}, True, 1.0),
    ({"kascade.io_live": "true"}, True, B.LIVE_PRIOR_WEIGHT),  # until its engine reports its share
    ({}, True, None),  # bound, loading, no live pair
    ({"kascade.io_loaded": "true"}, False, None),  # readinessProbe failing
    ({"kascade.io_loaded": "true", "kascade.io_draining": "2026-01-01T00:00:00Z"}, True, None),
    ({"kascade.io_loaded": "true", "kascade.io_unhealthy": "unreachable"}, True, None),
])
def test_only_ready_loaded_or_live_undrained_pods_serve(ann: dict[str, str], ready: bool, weight: float | None) -> None:
    r = pod_backend(pod("p", "10.0.0.1:8000", ready=ready, **ann))
    assert (r.weight if r else None) == weight


@pytest.mark.parametrize(("gate", "routed"), [(None, False), ("False", False), ("True", True)])
def test_the_operators_serving_gate_must_be_open(gate: str | None, routed: bool) -> None:
    p = pod("p", "10.0.0.1:8000", **LOADED)
    p["spec"] = {"readinessGates": [{"conditionType": B.SERVING_GATE}]}
    if gate is not None:
        p["status"]["conditions"].append({"type": B.SERVING_GATE, "status": gate})
    assert (pod_backend(p) is not None) is routed
    p["spec"] = {}  # a pod that declares no gate (e.g. made by hand): Ready alone decides
    assert pod_backend(p) is not None


def test_live_weight_is_the_share_the_engine_reports() -> None:
    r = Routes()
    r.set_service("ns", "svc", "m")
    r.set_pod(pod("a", "h:1", **{"kascade.io_live": "true"}))
    (b,) = r.serving(("ns", "svc"))
    assert b.live and b.weight == B.LIVE_PRIOR_WEIGHT
    b.reported("0.25")
    assert b.weight == 0.25
    for junk in ("x", str(B.MAX_WEIGHT + 1), "-1", "nan", None):
        b.reported(junk)
    assert b.weight == 0.25
    b.reported("4")  # the head of a pipeline of 4 receivers: weighs what 4 replicas do
    assert b.weight == 4.0
    b.reported("0.01")
    assert b.weight == B.MIN_WEIGHT  # one layer of many: still an occasional request
    b.reported("0")  # nothing landed yet when it answered: not a reason to starve it, the weight stays
    assert b.weight == B.MIN_WEIGHT
    r2 = Routes()
    r2.set_service("ns", "svc", "m")
    r2.set_pod(pod("z", "h:2", **{"kascade.io_live": "true"}))
    (z,) = r2.serving(("ns", "svc"))
    z.reported("0")  # a first answer before its first layer: it keeps the prior, and gets requests to report again
    assert z.weight == B.LIVE_PRIOR_WEIGHT
    z.reported("0.125")
    assert z.weight == 0.125
    b.reported("0.75")
    r.set_pod(pod("a", "h:1", **{"kascade.io_live": "true", "other": "x"}))  # another change of the pod
    assert r.serving(("ns", "svc"))[0].weight == 0.75  # the report is kept while it stays live
    r.set_pod(pod("a", "h:1", **LOADED))
    (b,) = r.serving(("ns", "svc"))
    assert b.weight == 1.0 and not b.live
    b.reported("0.3")  # a complete copy's weight is 1 whatever it says
    assert b.weight == 1.0


def test_address_from_pod_ip_and_named_port() -> None:
    p = pod("p", "", **LOADED)
    p["metadata"]["annotations"].pop(B.ENDPOINT)
    p["status"]["podIP"] = "10.1.2.3"
    p["spec"] = {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]}
    r = pod_backend(p)
    assert r is not None and r.address == "10.1.2.3:8000"


def test_routes_follow_pod_changes() -> None:
    r = Routes()
    r.set_service("ns", "svc", "m")
    r.set_pod(pod("a", "h:1", **LOADED))
    r.set_pod(pod("b", "h:2"))  # loading
    assert [b.pod for b in r.serving(("ns", "svc"))] == ["a"]
    r.set_pod(pod("b", "h:2", **LOADED))
    r.set_pod(pod("a", "h:1", **{"kascade.io_draining": "now"}, **LOADED))
    assert {b.pod for b in r.serving(("ns", "svc"))} == {"b"}
    r.remove_pod("ns", "b")
    assert r.serving(("ns", "svc")) == []
    assert r.lookup("m") == ("ns", "svc") and r.lookup("other") is None
    r.remove_service("ns", "svc")
    assert r.lookup("m") is None


def test_power_of_two_choices_prefers_fewer_in_flight_per_weight() -> None:
    rng = random.Random(1)
    busy, idle = Backend("busy", "h:1", in_flight=5), Backend("idle", "h:2")
    assert all(pick([busy, idle], rng) is idle for _ in range(20))
    live = Backend("live", "h:3", weight=0.5, in_flight=1)  # (1+1)/0.5 = 4 > (0+1)/1
    assert pick([live, Backend("full", "h:4")], rng).pod == "full"  # type: ignore[union-attr]
    assert pick([busy, idle], rng, exclude={"idle"}) is busy
    assert pick([busy], rng, exclude={"busy"}) is None
    # over many picks among equal backends the load spreads
    bs = [Backend(f"b{i}", "h") for i in range(4)]
    for _ in range(400):
        pick(bs, rng).in_flight += 1  # type: ignore[union-attr]
    assert max(b.in_flight for b in bs) - min(b.in_flight for b in bs) <= 2


def test_static_backend_spec_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="expected MODEL=HOST:PORT"):
        static_routes(["nohost"])
    with pytest.raises(ValueError, match="'x' is not HOST:PORT"):
        static_routes(["m=x"])


# -- in-process router + stub engines -------------------------------------------------------------------
World = tuple[Router, list[StubEngine], str]


@pytest.fixture
async def world() -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    async def make(n: int = 2, settings: RouterSettings | None = None, **stub: Any) -> World:
        engines = [await StubEngine(name=f"e{i}", **stub).start() for i in range(n)]
        routes = static_routes([f"m={','.join(e.address for e in engines)}"]) if engines else Routes()
        if not engines:
            routes.set_service("static", "m", "m")
        r = await Router(settings or RouterSettings(hold_timeout_s=2.0), routes).start()
        made.extend([r, *engines])
        return r, engines, f"http://127.0.0.1:{r.port}"

    yield make
    for x in made:
        await x.close()


async def post(url: str, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/v1/completions", data=raw if raw is not None else json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()  # type: ignore[return-value]


async def test_routes_by_model_and_relays_the_answer(world: Callable[..., Any]) -> None:
    r, engines, url = await world(2)
    st, h, body = await post(url, {"model": "m", "prompt": "hi"}, headers={"X-Request-Id": "abc-1"})
    assert st == 200 and json.loads(body)["choices"][0]["text"] == " t0 t1 t2 t3"
    assert h["X-Request-Id"] == "abc-1" and h["X-Kascade-Replica"] in ("m-0", "m-1")
    assert [s.request_id for e in engines for s in e.seen] == ["abc-1"]
    st, h, _ = await post(url, {"model": "m", "prompt": "hi"})
    assert len(h["X-Request-Id"]) == 32  # generated when the client sends none
    d = r.demand.snapshot()["models"]["static/m"]
    assert d["requestsPerSecond"] > 0 and d["inFlight"] == 0


async def test_bad_input_gets_clear_errors(world: Callable[..., Any]) -> None:
    _, engines, url = await world(1, settings=RouterSettings(max_body_bytes=1000))
    st, _, body = await post(url, {"model": "nope", "prompt": "x"})
    assert st == 404 and "model 'nope' is not served here" in body.decode() and "known models: m" in body.decode()
    st, _, body = await post(url, None, raw=b'{"model": "m", "prompt": ')
    assert st == 400 and "malformed JSON" in body.decode()
    st, _, body = await post(url, {"prompt": "x"})
    assert st == 400 and json.loads(body)["error"]["param"] == "model"
    st, _, body = await post(url, ["m"])
    assert st == 400 and "JSON object" in body.decode()
    st, _, body = await post(url, {"model": "m", "prompt": "x" * 2000})
    assert st == 413 and "1000" in body.decode()
    assert engines[0].seen == []  # nothing bad reached an engine


async def test_streams_chunks_through_without_buffering(world: Callable[..., Any]) -> None:
    hold = asyncio.Event()
    _, engines, url = await world(1, hold=hold)
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                    json={"model": "m", "prompt": "x", "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)  # before the engine sends more
        assert b'" t0"' in first and not engines[0].seen[0].finished
        hold.set()
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 4


async def test_retries_only_failures_before_the_first_byte(world: Callable[..., Any]) -> None:
    r, engines, url = await world(2)
    dead = "127.0.0.1:1"  # refused
    r.routes.set_pod(pod("dead", dead, svc="m", ns="static", **LOADED))
    engines[0].status = 503  # draining: answers 503 before doing anything
    dead_b = r.routes.backends[("static", "m")]["dead"]
    sent, ejected_at = 0, None
    # the balancer samples at random: send until the dead replica has been tried at least once (it is
    # ejected at its first refused connect), and at least 6 requests; every one must succeed
    while sent < 6 or (ejected_at is None and sent < 60):
        st, _, _ = await post(url, {"model": "m", "prompt": "x"})
        assert st == 200
        sent += 1
        if ejected_at is None and not dead_b.usable(time.monotonic()):
            ejected_at = sent
    assert ejected_at is not None, "the dead replica was never ejected"
    assert all(s.finished for s in engines[1].seen) and len(engines[1].seen) == sent


async def test_failure_mid_stream_is_not_retried(world: Callable[..., Any]) -> None:
    hold = asyncio.Event()
    _, engines, url = await world(1, hold=hold)
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                    json={"model": "m", "prompt": "x", "stream": True}) as resp:
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        engines[0].abort()  # the replica dies mid-stream
        rest = await asyncio.wait_for(resp.read(), 5)
    assert b"failed mid-stream" in rest and len(engines[0].seen) == 1


async def test_client_disconnect_cancels_the_engine_request(world: Callable[..., Any]) -> None:
    hold = asyncio.Event()
    r, engines, url = await world(1, hold=hold)
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if engines[0].seen[0].disconnected:
            break
        await asyncio.sleep(0.02)
    assert engines[0].seen[0].disconnected and not engines[0].seen[0].finished
    assert r.demand.models[("static", "m")].in_flight == 0


async def test_a_live_replica_is_weighted_by_its_engines_report(world: Callable[..., Any]) -> None:
    r, _, url = await world(0)
    eng = await StubEngine(name="live", share="0.3750").start()
    try:
        r.routes.set_pod(pod("live", eng.address, svc="m", ns="static", **{"kascade.io_live": "true"}))
        assert r.routes.serving(("static", "m"))[0].weight == B.LIVE_PRIOR_WEIGHT
        for stream, share in ((False, "0.3750"), (True, "0.8750")):  # more layers resident: a larger share
            eng.share = share
            st, h, _ = await post(url, {"model": "m", "prompt": "x", "stream": stream})
            assert st == 200 and h["X-Kascade-Replica"] == "live"
            assert r.routes.serving(("static", "m"))[0].weight == float(share)
        async with aiohttp.ClientSession() as s, s.get(f"{url}/router/v1/routes") as resp:
            table = await resp.json()
        assert table["m"]["backends"][0]["weight"] == 0.875
    finally:
        await eng.close()


async def test_a_live_replicas_weight_is_refreshed_between_its_answers(world: Callable[..., Any]) -> None:
    """A live replica picked rarely reports rarely: its weight is re-read from its engine (/readyz) anyway,
    with no request sent to it; with the refresh off (0) it keeps its prior until it answers a request."""
    polled, _, _ = await world(0, settings=RouterSettings(hold_timeout_s=2.0, live_share_refresh_s=0.05))
    quiet, _, _ = await world(0, settings=RouterSettings(hold_timeout_s=2.0, live_share_refresh_s=0))
    eng = await StubEngine(name="live", share="0.1250").start()
    try:
        for r in (polled, quiet):
            r.routes.set_pod(pod("live", eng.address, svc="m", ns="static", **{"kascade.io_live": "true"}))

        async def weight_becomes(w: float) -> None:
            for _ in range(200):
                if polled.routes.serving(("static", "m"))[0].weight == w:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"weight {polled.routes.serving(('static', 'm'))[0].weight}, want {w}")

        await weight_becomes(0.125)
        eng.share = "0.6250"  # more layers landed
        await weight_becomes(0.625)
        assert eng.seen == [] and eng.readyz >= 2  # no request went to it: the polls did it
        assert quiet.routes.serving(("static", "m"))[0].weight == B.LIVE_PRIOR_WEIGHT
        # a complete replica is not polled: its weight is 1 whatever it says
        polled.routes.set_pod(pod("live", eng.address, svc="m", ns="static", **{"kascade.io_loaded": "true"}))
        before = eng.readyz
        await asyncio.sleep(0.2)
        assert eng.readyz == before and polled.routes.serving(("static", "m"))[0].weight == 1.0
    finally:
        await eng.close()


async def test_holds_requests_until_a_replica_serves(world: Callable[..., Any]) -> None:
    r, _, url = await world(0, settings=RouterSettings(hold_timeout_s=5.0))
    eng = await StubEngine(name="late").start()
    try:
        task = asyncio.create_task(post(url, {"model": "m", "prompt": "x"}))
        await asyncio.sleep(0.3)
        assert r.demand.models[("static", "m")].queued == 1 and not task.done()
        metrics = (await (await aiohttp.ClientSession().__aenter__()).get(f"{url}/metrics")).status
        assert metrics == 200
        r.routes.set_pod(pod("late", eng.address, svc="m", ns="static", **LOADED))  # the watch sees it
        st, _, _ = await asyncio.wait_for(task, 5)
        assert st == 200 and len(eng.seen) == 1 and r.demand.models[("static", "m")].queued == 0
    finally:
        await eng.close()


async def test_hold_is_bounded_in_time_and_size(world: Callable[..., Any]) -> None:
    _, _, url = await world(0, settings=RouterSettings(hold_timeout_s=0.5, max_queued=2, retry_after_s=7))
    held = [asyncio.create_task(post(url, {"model": "m", "prompt": "x"})) for _ in range(2)]
    await asyncio.sleep(0.2)
    st, h, body = await post(url, {"model": "m", "prompt": "x"})
    assert st == 429 and h["Retry-After"] == "7" and "limit 2" in body.decode()
    for st, h, body in await asyncio.gather(*held):
        assert st == 503 and h["Retry-After"] == "7" and "scaling from zero" in body.decode()


async def test_metrics_export_demand_per_model(world: Callable[..., Any]) -> None:
    _, _, url = await world(1)
    await post(url, {"model": "m", "prompt": [1, 2, 3]})
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    assert 'kascade_router_requests_total{code="200",model="m",model_service="m",namespace="static"} 1.0' in text
    assert 'kascade_router_tokens_total{kind="input",model="m",model_service="m",namespace="static"} 3.0' in text
    assert 'kascade_router_tokens_total{kind="output",model="m",model_service="m",namespace="static"} 4.0' in text
