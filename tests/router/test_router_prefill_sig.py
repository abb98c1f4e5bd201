"""Issue 38: the prefill peers a router names to a decode engine (X-Kascade-Prefill) carry its signature keyed by
the engine token (X-Kascade-Prefill-Sig), which engines started with --require-prefill-signature demand
(tests/engine/test_prefill_signature.py); a client's own headers never reach the engine."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from kascade_planner.engine_api import PREFILL_HEADER, PREFILL_SIG_HEADER, prefill_signature
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings


async def recorder() -> tuple[web.AppRunner, int, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    async def complete(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": " x", "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1], seen  # type: ignore[union-attr]


async def one(token: str, client_headers: dict[str, str]) -> dict[str, str]:
    dec, dport, seen = await recorder()
    pre, pport, _ = await recorder()
    spec = f"m=decode@127.0.0.1:{dport},prefill@127.0.0.1:{pport}+127.0.0.1:7"
    r = await Router(RouterSettings(engine_token=token), static_routes([spec])).start()
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{r.port}/v1/completions", headers=client_headers,
                json={"model": "m", "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
        (h,) = seen
        return h
    finally:
        await r.close()
        await dec.cleanup()
        await pre.cleanup()


async def test_the_router_signs_the_prefill_peer_it_names() -> None:
    h = await one("engine-token", {PREFILL_HEADER: "10.9.9.9:1", PREFILL_SIG_HEADER: "forged"})
    assert h[PREFILL_HEADER] == "127.0.0.1:7"  # the router's choice, not the client's
    assert h[PREFILL_SIG_HEADER] == prefill_signature("engine-token", "127.0.0.1:7", None)


async def test_without_the_token_no_signature_is_sent() -> None:
    h: Any = await one("", {})
    assert h[PREFILL_HEADER] == "127.0.0.1:7" and PREFILL_SIG_HEADER not in h
