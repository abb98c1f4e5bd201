"""Live cooperation over HTTP: a loading engine B (2 of 4 layers resident, a real process) told to
cooperate with A serves requests by running its prefix and shipping activations to A's data port;
the tokens equal A's own."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.mark.parametrize("mode", ["besteffort", "zigzag"])
def test_loading_engine_serves_split_with_peer(engine_a, tiny_ckpt, engine_starter, mode: str) -> None:
    b = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--resident-layers", "2"])
    try:
        h = {"Authorization": f"Bearer {b.token}"}
        body = {"model": "tiny-llama", "prompt": "split me", "max_tokens": 7}
        r = httpx.post(b.url + "/v1/completions", json=body)
        assert r.status_code == 503 and "2/4 layers resident" in r.json()["error"]["message"]
        st = httpx.get(b.url + "/kascade/v1/status", headers=h).json()
        assert st["phase"] == "loading" and st["blocks"]["layer.1"] and not st["blocks"]["layer.2"]
        assert httpx.get(b.url + "/readyz").status_code == 503  # loading alone: not Ready
        r = httpx.post(b.url + "/kascade/v1/cooperate", json={"peer": f"127.0.0.1:{engine_a.act}", "mode": mode},
                       headers=h)
        assert r.status_code == 200 and r.json()["cooperate"]["mode"] == mode
        want = httpx.post(engine_a.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        r = httpx.post(b.url + "/v1/completions", json=body)
        got = r.json()
        assert got["choices"][0]["text"] == want and got["usage"]["completion_tokens"] == 7
        # it runs 2 of the 4 layers itself: the share routers weight it by
        assert r.headers["X-Kascade-Serving-Share"] == "0.5000"
        assert httpx.post(engine_a.url + "/v1/completions", json=body).headers["X-Kascade-Serving-Share"] == "1.0000"
        c = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **body))
        assert streamed == want
        assert "kascade_live_split_requests_total 2.0" in httpx.get(b.url + "/metrics").text
        ready = httpx.get(b.url + "/readyz")
        assert ready.status_code == 200  # live: Ready, routers may send to it
        assert ready.headers["X-Kascade-Serving-Share"] == "0.5000"  # and re-read its weight here between answers
        httpx.post(b.url + "/kascade/v1/cooperate", json={"peer": "", "mode": "off"}, headers=h)
        assert httpx.get(b.url + "/readyz").status_code == 503
    finally:
        b.stop()


def test_activation_port_needs_the_installation_token(engine_a) -> None:
    """Only an engine holding the same token may make A run layers: a wrong hello is cut off."""
    import asyncio

    from kascade_engine.net import peerauth
    from kascade_engine.net.transport import TransportError
    from kascade_engine.net.transport_tcp import TcpTransport

    async def hello(token: str) -> str:
        conn = await TcpTransport().connect("127.0.0.1", engine_a.act)
        try:
            await peerauth.join(conn, token, "activation", timeout=10)
            return "welcome"
        except TransportError as e:
            return f"closed: {e}"
        finally:
            await conn.close()

    assert asyncio.run(hello(engine_a.token)) == "welcome"
    assert asyncio.run(hello("not-the-token")).endswith("refused the hello: authentication failed")
