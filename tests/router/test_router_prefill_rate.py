"""A converted decoder weighed by its measured prefill rate, not a fixed share of a prefill engine.

- The rule (pure): the balancer counts a converted decoder's prompt as 1 / share of a prefill engine's, share =
  the decoder's reported prefill rate over the prefill engines' (kascade_planner.conversion.converted_share),
  the constant CONVERTED_SHARE only while either is unreported; the engine's header parses as the room's does.
- On REAL engine processes (a tiny random Llama on CPU, each step at least 10 ms a layer: an emulated
  accelerator, so a step's time hardly depends on its tokens): D converted with a 2-token chunk cap prefills its
  own prompts at a small share of what P, at 32 tokens a step, does. Both report it (PREFILL_RATE_HEADER) on
  /readyz, D also on its answers; the router learns P's by its poll (it never hears P's answers in PD serving)
  and D's by both. With those rates the router sends the next prompt to P while P holds 2 (the constant would
  give it to D). A new conversion budget forgets D's rate (the header is gone, the router's poll clears it); an
  answer carries the rate as of its start (a router clears what it knew on an answer without one).
Fails on the old code: the balancer ranked D at 0.5 of P whatever it reported, and no engine reported a rate.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.localengine import EngineProc, start_engine
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.conversion import CONVERTED_SHARE, MIN_SHARE, converted_share
from kascade_planner.engine_api import PREFILL_RATE_HEADER, ConvertRequest
from kascade_router.backends import Backend
from kascade_router.balancer import pick_pd
from kascade_router.server import Router, static_routes

TOKEN = "router-prefill-rate-token"
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(40)] for i in range(4)]


def test_a_converted_decoder_is_ranked_by_its_measured_share_of_a_prefill_engine() -> None:
    """At 90 tok/s against P's 900 (share 0.1) D's next prompt costs 10: P takes it while it holds 2 (cost 3),
    where at the constant half (cost 2) D took it; D takes one only once P holds 10 (cost 11). Unmeasured on
    either side: the constant again. A rate of 0 (its budgets gave prompts nothing) is the smallest share."""
    rng = random.Random(3)
    d = Backend("d", "h:1", role="decode", data="h:10", convertible=True, in_flight=6)
    p = Backend("p", "h:2", role="prefill", data="h:20", in_flight=2, prefilling=2)
    assert CONVERTED_SHARE == 0.5 and all(pick_pd([d, p], rng) == (d, None) for _ in range(20))  # unmeasured
    d.reported_rate("90.0")
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))  # P's rate unknown: still the constant
    p.reported_rate("900.0")
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))
    p.in_flight = p.prefilling = 10
    assert all(pick_pd([d, p], rng) == (d, None) for _ in range(20))
    d.reported_rate("0")
    assert all(pick_pd([d, p], rng) == (d, p) for _ in range(20))  # 1 / MIN_SHARE = 100 > 11
    assert converted_share(0.0, 900.0) == MIN_SHARE


def test_the_prefill_rate_header_parses_like_the_room() -> None:
    b = Backend("d", "h:1", role="decode")
    b.reported_rate("123.5")
    assert b.prefill_rate == 123.5
    for bad in ("fast", "-1", "inf", "nan"):
        b.reported_rate(bad)
        assert b.prefill_rate == 123.5, bad
    b.reported_rate(None)  # no header: not measured (or its budgets changed)
    assert b.prefill_rate is None


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProc]]:
    ckpt = tiny_llama(tmp_path_factory.mktemp("rate") / "tiny-llama", layers=4, hidden=64, vocab=512)
    procs: dict[str, EngineProc] = {}
    try:
        # 10 ms a layer: the emulated accelerator's floor (40 ms a step) must dwarf the step's CPU work, which
        # CPU contention stretches. At 2 ms a layer (8 ms a step beside ~3 ms of compute for P's 32 tokens, 0.3 ms
        # for D's 2) a CI run at load 4-8 made P's steps 6x slower and D's 1.8x: D's share read 0.28, not ~0.08
        for role in ("prefill", "decode"):
            procs[role] = start_engine(["--checkpoint", str(ckpt), "--model-name", "tiny-llama", "--kv-tokens",
                                        "4096", "--max-batch-tokens", "32", "--emulate-layer-ms", "10"], TOKEN)
        yield procs
    finally:
        for e in procs.values():
            e.stop()


async def _complete(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, str]:
    """The answer's headers, names lower-cased."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        assert r.status == 200, await r.text()
        return {k.lower(): v for k, v in r.headers.items()}


async def _readyz_rate(s: aiohttp.ClientSession, url: str) -> str | None:
    async with s.get(f"{url}/readyz") as r:
        return r.headers.get(PREFILL_RATE_HEADER)


async def test_the_router_learns_both_engines_prefill_rates_and_ranks_the_decoder_by_them(
        engines: dict[str, EngineProc]) -> None:
    p, d = engines["prefill"], engines["decode"]
    p_url, d_url = f"http://127.0.0.1:{p.http}", f"http://127.0.0.1:{d.http}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    conv: Any = ConvertRequest(2).to_dict()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{d_url}/kascade/v1/convert", json=conv, headers=auth) as r:
            assert r.status == 200, await r.text()
        # D prefills these itself (no prefill engine named), 2 tokens a step; P at up to 32
        await asyncio.gather(*(_complete(s, d_url, q) for q in PROMPTS))
        await asyncio.gather(*(_complete(s, p_url, q) for q in PROMPTS))
        d_rate, p_rate = await _readyz_rate(s, d_url), await _readyz_rate(s, p_url)
        assert d_rate is not None and p_rate is not None
        assert PREFILL_RATE_HEADER.lower() in await _complete(s, d_url, PROMPTS[0])  # on its answers too
        share = converted_share(float(d_rate), float(p_rate))
        assert share < CONVERTED_SHARE / 2, (d_rate, p_rate)  # ~2/32 of P, never the fixed half

        routes = static_routes([f"tiny-llama=decode@127.0.0.1:{d.http}+127.0.0.1:{d.act},"
                                f"prefill@127.0.0.1:{p.http}+127.0.0.1:{p.act}"])
        (backends,) = routes.backends.values()
        db, pb = backends["tiny-llama-0"], backends["tiny-llama-1"]
        db.convertible = True  # what the pod annotation kascade.io/convertible does
        router = await Router(routes=routes).start()
        try:
            assert router.shares is not None
            await router.shares.refresh()  # the poll also runs every 0.25 s; once is enough here
            assert db.prefill_rate is not None and pb.prefill_rate is not None
            pb.in_flight = pb.prefilling = 2
            rng = random.Random(1)
            seen = (db.prefill_rate, pb.prefill_rate, db.prefilling, db.prefill_room, db.in_flight, d_rate, p_rate)
            picks = {tuple(x.pod if x else None for x in pick_pd([db, pb], rng)) for _ in range(20)}
            assert picks == {("tiny-llama-0", "tiny-llama-1")}, (picks, seen)
            db.prefill_rate = None  # as the router stood before it learned D's rate: the constant share
            assert all(pick_pd([db, pb], rng) == (db, None) for _ in range(20))
            pb.in_flight = pb.prefilling = 0
            heads = await _complete(s, f"http://127.0.0.1:{router.port}", PROMPTS[0])  # D answers, P prefills
            assert heads.get("x-kascade-prefilled-by") == "tiny-llama-1"
            assert db.prefill_rate is not None  # learned again from D's answer
            async with s.post(f"{d_url}/kascade/v1/convert", json=ConvertRequest(4).to_dict(), headers=auth) as r:
                assert r.status == 200
            assert await _readyz_rate(s, d_url) is None  # measured under the old budget: forgotten
            await router.shares.refresh()
            assert db.prefill_rate is None and pb.prefill_rate is not None
            # an answer's headers are built when it starts, not when its request arrived: this prompt arrives
            # with the rate unknown and is answered after 10 steps of its own prefill (4 tokens each) measured it
            assert PREFILL_RATE_HEADER.lower() in await _complete(s, d_url, PROMPTS[1])
        finally:
            await router.close()
            async with s.post(f"{d_url}/kascade/v1/convert", json={"prefillChunkTokens": None}, headers=auth) as r:
                assert r.status == 200
