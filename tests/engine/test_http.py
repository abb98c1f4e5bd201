"""The HTTP API of a real engine process: OpenAI client (streaming and not), 4xx on bad input naming
the problem, control API token, and a burst of bad input that leaves the engine serving."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest


def _client(engine_a) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_a.url + "/v1", api_key="unused", max_retries=0)


def test_openai_completions_stream_and_not(engine_a) -> None:
    c = _client(engine_a)
    r = c.completions.create(model="tiny-llama", prompt="hello", max_tokens=6)
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 5
    assert r.choices[0].finish_reason == "length"
    chunks = list(c.completions.create(model="tiny-llama", prompt="hello", max_tokens=6, stream=True))
    assert len(chunks) == 6
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text  # greedy: same text
    ids = c.completions.create(model="tiny-llama", prompt=[104, 101], max_tokens=2)
    assert ids.usage.prompt_tokens == 2


def test_openai_chat_stream_and_not(engine_a) -> None:
    c = _client(engine_a)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=4)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 4
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=4, stream=True))
    assert text == r.choices[0].message.content


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"model": "nope", "prompt": "x"}, 404, "model 'nope' is not served"),
    ({"model": "tiny-llama", "prompt": "x" * 65}, 400, "prompt has 65 tokens, the limit is 64"),
    ({"model": "tiny-llama"}, 400, "'prompt'"),
    ({"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, 400, "'max_tokens'"),
    ({"model": "tiny-llama", "prompt": "x", "temperature": "hot"}, 400, "'temperature'"),
    ({"model": "tiny-llama", "prompt": [1, 99999]}, 400, "token ids must be in 0..511"),
    ({"model": "tiny-llama", "prompt": ""}, 400, "prompt is empty"),
])
def test_bad_completion_bodies(engine_a, body, status: int, needle: str) -> None:
    r = httpx.post(engine_a.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_chat_and_not_json(engine_a) -> None:
    r = httpx.post(
        engine_a.url + "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
    r = httpx.post(engine_a.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_control_api_needs_token(engine_a) -> None:
    u = engine_a.url + "/kascade/v1/"
    assert httpx.get(u + "status").status_code == 401
    assert httpx.get(u + "status", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.post(u + "drain").status_code == 401
    ok = httpx.get(u + "status", headers={"Authorization": f"Bearer {engine_a.token}"})
    assert ok.status_code == 200
    st = ok.json()
    assert st["phase"] == "serving" and st["ready"] and all(st["blocks"].values()) and len(st["blocks"]) == 6
    h = {"Authorization": f"Bearer {engine_a.token}"}
    r = httpx.post(u + "cooperate", json={"peer": "b", "mode": "sideways"}, headers=h)
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    r = httpx.post(u + "bind", json={"model": "other", "modelService": "m", "role": "prefill"}, headers=h)
    assert r.status_code == 409 and "other" in r.json()["error"]["message"]


def test_burst_of_bad_input_keeps_engine_up(engine_a) -> None:
    bad = [b"\x00\xff", b"[]", b'{"model": 5}', b'{"model": "tiny-llama", "prompt": {"a": 1}}', b"x" * 100000]

    async def burst() -> list[int]:
        # generous timeouts: the point is the answers (4xx, engine up), not speed on a loaded machine
        async with httpx.AsyncClient(base_url=engine_a.url, timeout=120, limits=httpx.Limits(max_connections=50)) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", content=bad[i % len(bad)],
                                               headers={"content-type": "application/json"}) for i in range(200)])
            return [r.status_code for r in rs]

    codes = asyncio.run(burst())
    assert all(400 <= c < 500 for c in codes), set(codes)
    assert httpx.get(engine_a.url + "/healthz").status_code == 200
    r = _client(engine_a).completions.create(model="tiny-llama", prompt="ok", max_tokens=2)
    assert r.usage.completion_tokens == 2
    m = httpx.get(engine_a.url + "/metrics").text
    assert 'kascade_time_to_first_token_seconds_count{model_name="tiny-llama"}' in m
    assert (
        "kascade_blocks_resident 6.0" in m
        and 'kascade_request_success_total{finished_reason="length",model_name="tiny-llama"}' in m
    )


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_disconnect_frees_pages_at_once(engine_a) -> None:
    """A streaming client that goes away mid-generation: the request is aborted and its KV pages freed
    long before its max_tokens would have run out (observed through the engine's own metrics)."""
    import time

    aborts = _metric(engine_a.url, 'kascade_request_success_total{finished_reason="abort",model_name="tiny-llama"}')
    gen_before = _metric(engine_a.url, 'kascade_generation_tokens_total{model_name="tiny-llama"}')
    body = {"model": "tiny-llama", "prompt": "go on and on", "max_tokens": 480, "stream": True}  # context 512
    with httpx.stream("POST", engine_a.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 8:  # data line, blank line, ...: four tokens in
                assert _metric(engine_a.url, "kascade_kv_cache_usage_perc") > 0
                assert _metric(engine_a.url, "kascade_num_requests_running") == 1
                break
    deadline = time.monotonic() + 5
    while _metric(engine_a.url, "kascade_kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric(engine_a.url, "kascade_kv_cache_usage_perc") == 0
    assert _metric(engine_a.url, "kascade_num_requests_running") == 0
    got = _metric(engine_a.url, 'kascade_request_success_total{finished_reason="abort",model_name="tiny-llama"}')
    assert got == aborts + 1
    assert _metric(engine_a.url, 'kascade_generation_tokens_total{model_name="tiny-llama"}') < gen_before + 480


@pytest.mark.smollm
def test_smollm_chat_over_http(smollm_ckpt, engine_starter) -> None:
    e = engine_starter(["--smollm", "--model-name", "smollm2-135m", "--threads", "2"])
    try:
        c = openai.OpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2-135m", max_tokens=12,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.choices[0].message.content or ""), r.choices[0].message.content
        r2 = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4)
        assert "Paris" in r2.choices[0].text
    finally:
        e.stop()


def test_a_load_watch_is_held_until_prompt_tokens_per_s_leave_the_band(engine_a) -> None:
    """kascade_planner.loadwatch on the real engine: a band the engine is in holds /metrics until the wait; a
    request's prompt tokens push the 1 s rate above it and the held answer comes at once; a bad query is a 400."""
    import threading
    import time

    q = "/metrics?above=1&below=-1&window=1&wait="
    t0 = time.monotonic()
    assert httpx.get(engine_a.url + q + "0.5", timeout=30).status_code == 200
    assert time.monotonic() - t0 >= 0.45  # idle: held for the whole wait
    answered: list[float] = []

    def watch() -> None:
        r = httpx.get(engine_a.url + q + "60", timeout=90)
        assert r.status_code == 200 and "kascade_prompt_tokens_total" in r.text
        answered.append(time.monotonic())

    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.5)
    assert not answered
    sent = time.monotonic()
    _client(engine_a).completions.create(model="tiny-llama", prompt="hello", max_tokens=1)
    t.join(30)
    assert answered and answered[0] - sent < 10  # within ticks of the request, not the 60 s wait
    bad = httpx.get(engine_a.url + "/metrics?above=1&below=2&window=1&wait=5", timeout=30)
    assert bad.status_code == 400 and "below:" in bad.text
