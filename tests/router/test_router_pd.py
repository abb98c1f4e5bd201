"""PD routing through the router to real engine processes: the router picks a decode engine, then a
prefill engine for it, and sends the request to the decode engine naming the prefill engine's data port;
the prefill engine's KV moves to the decode engine over the engines' `--transport` (tcp, and ucx: the same
test twice) and the answer streams from the decode engine. Outputs equal the same decode engine's colocated
answers; both engines' /metrics show the KV that moved, and the transport's own byte counters
(`kascade_data_port_bytes_total{transport}`) show it went over the configured transport."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_router.backends import Backend
from kascade_router.balancer import fallback_prefill, pick_pd
from kascade_router.server import Router, static_routes

TOKEN = "router-pd-token"


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def transport(request: pytest.FixtureRequest) -> str:
    from kascade_devcluster.requirement import need_transport

    return need_transport(str(request.param))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[dict[str, tuple[int, int]]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("pd") / "tiny-llama", layers=4, hidden=64, vocab=512)
    procs: list[EngineProc] = []
    try:
        for _ in ("prefill", "decode"):
            procs.append(start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens", "4096",
                                       "--max-batch-tokens", "32", "--transport", transport], TOKEN))
        yield {"prefill": (procs[0].http, procs[0].act), "decode": (procs[1].http, procs[1].act)}
    finally:
        for e in procs:
            e.stop()


@pytest.fixture
async def router(engines: dict[str, tuple[int, int]]) -> AsyncIterator[Router]:
    (ph, pa), (dh, _) = engines["prefill"], engines["decode"]
    spec = f"tiny-llama=decode@127.0.0.1:{dh},prefill@127.0.0.1:{ph}+127.0.0.1:{pa}"
    r = await Router(routes=static_routes([spec])).start()
    try:
        yield r
    finally:
        await r.close()


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


async def _complete(s: aiohttp.ClientSession, url: str, prompt: list[int], stream: bool) -> tuple[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["choices"][0]["text"], r.headers
        text = ""
        async for line in r.content:
            if line.startswith(b"data: {"):
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
        return text, r.headers


async def test_router_routes_pd_and_output_equals_colocated(engines: dict[str, tuple[int, int]],
                                                             router: Router, transport: str) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [1, 2, 3], [300, 200, 100, 50]]
    d_url, p_url = f"http://127.0.0.1:{engines['decode'][0]}", f"http://127.0.0.1:{engines['prefill'][0]}"
    async with aiohttp.ClientSession() as s:
        before = {u: await (await s.get(f"{u}/metrics")).text() for u in (d_url, p_url)}
        want = [(await _complete(s, d_url, p, False))[0] for p in prompts]  # colocated: D alone, no header
        got = await asyncio.gather(*(_complete(s, f"http://127.0.0.1:{router.port}", p, st)
                                     for p in prompts for st in (False, True)))
        after = {u: await (await s.get(f"{u}/metrics")).text() for u in (d_url, p_url)}
    assert [t for t, _ in got] == [w for w in want for _ in (0, 1)]
    assert all(h["X-Kascade-Replica"] == "tiny-llama-0" and h["X-Kascade-Prefilled-By"] == "tiny-llama-1"
               for _, h in got)

    def delta(u: str, name: str, **labels: str) -> float:
        return _metric(after[u], name, **labels) - _metric(before[u], name, **labels)

    n = 2 * len(prompts)
    assert delta(p_url, "kascade_pd_prefills_served_total") == n
    assert delta(d_url, "kascade_pd_remote_prefills_total") == n
    assert delta(d_url, "kascade_pd_local_fallbacks_total") == 0
    kv = 2 * sum(len(p) for p in prompts) * 2 * 4 * 2 * 16 * 4  # twice each; K+V, 4 layers, 2 kv heads x 16, fp32
    assert delta(p_url, "kascade_kv_transfer_bytes_total", direction="sent") == kv
    assert delta(d_url, "kascade_kv_transfer_bytes_total", direction="received") == kv
    # counted by the transport where the payloads met the wire, under the engines' --transport: KV frames are
    # the only payloads the data port carried here (the hellos have none)
    assert delta(p_url, "kascade_data_port_bytes_total", transport=transport, direction="sent") == kv
    assert delta(d_url, "kascade_data_port_bytes_total", transport=transport, direction="received") == kv
    assert _metric(after[d_url], "kascade_kv_link_bytes_per_second") > 0


def test_pick_pd_chooses_decode_then_prefill() -> None:
    rng = random.Random(1)
    d1, d2 = Backend("d1", "h:1", role="decode"), Backend("d2", "h:2", role="decode")
    p1 = Backend("p1", "h:3", role="prefill", data="h:30")
    p2 = Backend("p2", "h:4", role="prefill", data="h:40", in_flight=5)
    picks = [pick_pd([d1, d2, p1, p2], rng) for _ in range(50)]
    assert {d.pod for d, _ in picks if d} == {"d1", "d2"}  # the response always streams from a decoder
    assert {p.pod for _, p in picks if p} == {"p1"}  # of two prefill engines, the less busy one
    assert pick_pd([d1, p1], rng, exclude={"d1"}) == (p1, None)  # no decoder left: the prefill engine serves alone
    c = Backend("c", "h:5")
    assert pick_pd([c, p1], rng) == (c, None)  # a colocated replica prefills itself
    assert pick_pd([d1], rng) == (d1, None)  # no prefill engine: the decoder prefills itself


def test_a_converted_decoder_busy_decoding_still_takes_prefill() -> None:
    """Ranked by the prompts it prefills, not by its streams: a converted decoder decoding 10 requests
    (3 of them prefilled by p) and prefilling none takes the next prompt from p, which prefills 3. By
    in_flight (10 vs 3) it never would: every request p prefills is also in flight at the decoder."""
    rng = random.Random(1)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True, in_flight=10, prefilling=0)
    p = Backend("p", "h:2", role="prefill", data="h:20", in_flight=3, prefilling=3)
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))
    d.prefilling = 5  # now it prefills more than p: p takes the prompt
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))


def test_static_pd_backends_parse_and_name_bad_values() -> None:
    routes = static_routes(["m=decode@127.0.0.1:1,prefill@127.0.0.1:2+127.0.0.1:3"])
    bs = sorted(routes.backends[("static", "m")].values(), key=lambda b: b.pod)
    assert [(b.role, b.address, b.data) for b in bs] == [("decode", "127.0.0.1:1", None),
                                                        ("prefill", "127.0.0.1:2", "127.0.0.1:3")]
    with pytest.raises(ValueError, match="role 'boss'"):
        static_routes(["m=boss@127.0.0.1:1"])
    with pytest.raises(ValueError, match=r"needs \+DATA_HOST:PORT"):
        static_routes(["m=prefill@127.0.0.1:1"])
    with pytest.raises(ValueError, match="'nope' is not HOST:PORT"):
        static_routes(["m=prefill@127.0.0.1:1+nope"])


def test_convertible_decoders_take_prefill_for_other_decoders() -> None:
    from kascade_operator import labels as L
    from kascade_router import backends as B

    assert (B.ROLE, B.ACT_ENDPOINT, B.CONVERTIBLE) == (L.ROLE, L.ACT_ENDPOINT, L.CONVERTIBLE)
    rng = random.Random(3)
    d1 = Backend("d1", "h:1", role="decode", data="h:10")
    d2 = Backend("d2", "h:2", role="decode", data="h:20", convertible=True)
    assert pick_pd([d1, Backend("d2", "h:2", role="decode", data="h:20")], rng, exclude={"d2"}) == (d1, None)
    assert pick_pd([d1, d2], rng, exclude={"d2"}) == (d1, d2)  # the converted decoder prefills for d1
    assert pick_pd([d1, d2], rng, exclude={"d1"}) == (d2, None)  # chosen as the decoder: prefills its own
    busy = Backend("p", "h:3", role="prefill", data="h:30", in_flight=9)
    idle = Backend("q", "h:4", role="prefill", data="h:40")
    assert {pick_pd([d1, d2, busy], rng, exclude={"d2"})[1].pod for _ in range(20)} == {"d2"}  # type: ignore[union-attr]
    d2.prefilling = 3  # the converted decoder prefills 3 prompts, an idle prefill engine none: the engine prefills
    assert {pick_pd([d1, d2, idle], rng, exclude={"d2"})[1].pod for _ in range(20)} == {"q"}  # type: ignore[union-attr]
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {B.MODEL_SERVICE: "s", B.ROLE: "decode"},
                        "annotations": {B.LOADED: "true", B.ENDPOINT: "h:1", B.ACT_ENDPOINT: "h:9",
                                        B.CONVERTIBLE: "true"}},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    route = B.pod_backend(pod)
    assert route is not None and (route.role, route.data, route.convertible) == ("decode", "h:9", True)


def test_a_converted_decoder_weighs_its_prompts_by_its_share_and_prefills_one_at_a_time() -> None:
    """A converted decoder prefills at CONVERTED_SHARE (1/2) of a prefill engine's speed, so its next prompt
    counts double: against an idle prefill engine (1 vs 2) p takes it, where by prompt count alone (1 vs 1)
    half would go to d; against a prefill engine holding 2 (3 vs 2) d takes it. And it prefills one prompt
    at a time: with one in prefill it takes no other, however busy p is (by share alone, 4 < 10, it would)."""
    from kascade_planner.conversion import CONVERTED_SHARE

    assert CONVERTED_SHARE == 0.5
    rng = random.Random(1)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True, in_flight=10, prefilling=0)
    p = Backend("p", "h:2", role="prefill", data="h:20", in_flight=0, prefilling=0)
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))
    p.in_flight = p.prefilling = 2
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))
    d.prefilling, p.in_flight, p.prefilling = 1, 9, 9
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))


def test_a_prefill_engine_wins_a_tie_against_a_converted_decoder() -> None:
    """Equal cost (a prefill engine with one prompt: (1 + 1) / 1; an idle converted decoder: (0 + 2) / 1): the
    prefill engine takes the prompt every time, whichever of the two the sample draws first; one prompt more on
    it and the converted decoder takes it."""
    rng = random.Random(7)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True, in_flight=4, prefilling=0)
    p = Backend("p", "h:2", role="prefill", data="h:20", in_flight=1, prefilling=1)
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(40))
    assert all(pick_pd([p, d], rng) == (d, p) for _ in range(40))
    p.in_flight = p.prefilling = 2
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(40))


def test_a_converted_decoder_without_prefill_room_sends_prompts_to_a_prefill_engine() -> None:
    """A converted decoder whose step budget gives a chunk no tokens now (its reported prefill room 0, beside a
    big batch) takes no prompt while a prefill engine can, even a busy one: the prompt would wait there. With
    room again (or no report) it takes prompts as before; garbage reports are ignored, no header clears it."""
    from kascade_router.balancer import MIN_PREFILL_ROOM

    rng = random.Random(5)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True, in_flight=10)
    p = Backend("p", "h:2", role="prefill", data="h:20", in_flight=3, prefilling=3)
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))  # no report: it prefills locally
    d.reported_room("0")
    assert d.prefill_room == 0
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))
    d.reported_room("bad")
    assert d.prefill_room == 0
    d.reported_room(str(MIN_PREFILL_ROOM))
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))
    d.reported_room(None)
    assert d.prefill_room is None


def test_a_converted_decoder_prefilling_itself_is_given_a_prefill_engine_to_hand_back_to() -> None:
    """The hand-back's address (PREFILL_FALLBACK_HEADER): only for a converted decoder that prefills the prompt
    itself, the least loaded prefill engine with a data port; none when a prefill engine prefills it anyway,
    for a decoder not converted, or with no prefill engine to hand to."""
    rng = random.Random(1)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True)
    p1 = Backend("p1", "h:2", role="prefill", data="h:20", in_flight=4)
    p2 = Backend(
        "p2", "h:3", role="prefill", data="h:30", in_flight=2
    )  # busier than d with the prompt (3 > 2): d takes it
    p3 = Backend("p3", "h:4", role="prefill")  # no data port: KV cannot leave it
    assert pick_pd([d, p1, p2, p3], rng) == (d, None)  # it prefills none: it takes the prompt itself
    assert fallback_prefill([d, p1, p2, p3], d, None) is p2
    assert fallback_prefill([d, p1, p2], d, p2) is None  # p2 prefills it: nothing to hand back
    d.convertible = False
    assert fallback_prefill([d, p1, p2], d, None) is None
    d.convertible = True
    assert fallback_prefill([d, p3], d, None) is None


def test_a_converted_decoder_prefilling_for_another_is_given_a_prefill_engine_to_hand_back_to() -> None:
    """d1 decodes, converted d2 prefills for it: the prompt d2 declines or hands back goes to the least loaded
    prefill engine (named to d1, which passes it on in its prefill op), not to d1's own prefill. Neither decoder
    is ever its own fallback; a prefill engine as `pre` needs none."""
    rng = random.Random(2)
    d1 = Backend("d1", "h:1", role="decode", data="h:10", in_flight=3)
    d2 = Backend("d2", "h:2", role="decode", data="h:20", convertible=True)
    p1 = Backend("p1", "h:3", role="prefill", data="h:30", in_flight=6)
    p2 = Backend("p2", "h:4", role="prefill", data="h:40", in_flight=4)
    assert pick_pd([d1, d2, p1, p2], rng, exclude={"d2"}) == (d1, d2)  # both prefill engines busier: d2 prefills
    assert fallback_prefill([d1, d2, p1, p2], d1, d2) is p2
    assert fallback_prefill([d1, d2, p1, p2], d1, p1) is None  # a prefill engine prefills it: no hand-back
    assert fallback_prefill([d1, d2], d1, d2) is None  # nothing to hand to
    d2.convertible = False
    assert fallback_prefill([d1, d2, p1, p2], d1, d2) is None
