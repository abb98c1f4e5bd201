"""An engine bug in a request's handler answers an OpenAI-shaped 500 naming the exception (it was starlette's
plain-text "Internal Server Error": an OpenAI client, and the router's clients behind it, saw a bare
"Error code: 500", as in stop 46's killed-replica failure), and the engine still serves the next request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pdpair import instance

from kascade_engine.http.server import create_app


async def test_an_unexpected_failure_answers_an_openai_error_naming_it(tiny_ckpt: Path, tiny_blocks: Any) -> None:
    inst = instance(tiny_ckpt, tiny_blocks, "e")
    inst.serving.start()
    submit = inst.serving.submit
    failing = {"on": True}

    def broken(*args: Any, **kw: Any) -> str:
        if failing["on"]:
            raise RuntimeError("deque mutated during iteration")
        return submit(*args, **kw)

    inst.serving.submit = broken
    transport = httpx.ASGITransport(app=create_app(inst), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://e", timeout=60) as c:
            body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
            for stream in (False, True):
                r = await c.post("/v1/completions", json={**body, "stream": stream})
                assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
                err = r.json()["error"]
                assert err["type"] == "server_error" and err["code"] == 500
                assert err["message"] == "engine failed on this request: RuntimeError: deque mutated during iteration"
            failing["on"] = False
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        await inst.close()
