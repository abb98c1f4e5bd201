"""The OpenAI API as the official `openai` client uses it, against a real engine process: stop strings,
max_completion_tokens, the chat default (what fits in the context), stream_options.include_usage,
content parts, developer/system roles, tool calls refused with a 400 naming the field, n choices,
/v1/models, and OpenAI's error shape."""

from __future__ import annotations

import openai
import pytest


def _client(engine_a) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_a.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stop_in(text: str) -> tuple[str, int]:
    """A 2-character stop string from `text` whose first occurrence is at k >= 1."""
    for k in range(1, len(text) - 2):
        s = text[k:k + 2]
        if "\ufffd" not in s and text.find(s) == k:
            return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_text_and_stream(engine_a) -> None:
    c = _client(engine_a)
    full = c.completions.create(model="tiny-llama", prompt="stop here", max_tokens=40).choices[0].text
    stop, k = _stop_in(full)
    r = c.completions.create(model="tiny-llama", prompt="stop here", max_tokens=40, stop=[stop, "never-seen"])
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = list(c.completions.create(model="tiny-llama", prompt="stop here", max_tokens=40, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == full[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="at most 4 stop strings"):
        c.completions.create(model="tiny-llama", prompt="x", stop=["a", "b", "c", "d", "e"])


def test_chat_max_completion_tokens_default_and_usage_chunk(engine_a) -> None:
    c = _client(engine_a)
    msgs = [{"role": "user", "content": "count"}]
    r = c.chat.completions.create(model="tiny-llama", messages=msgs, max_completion_tokens=5, max_tokens=50)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    d = c.chat.completions.create(model="tiny-llama", messages=msgs)  # no limit: whatever fits the context
    assert d.usage.prompt_tokens + d.usage.completion_tokens == 512 and d.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="tiny-llama", messages=msgs, max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="exceeds the context of 512"):
        c.chat.completions.create(model="tiny-llama", messages=msgs, max_completion_tokens=600)


def test_content_parts_and_developer_role(engine_a) -> None:
    c = _client(engine_a)

    def say(messages):
        return c.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6).choices[0].message.content

    plain = say([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    parts = say([{"role": "developer", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}])
    assert parts == plain
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages.0.content.0.type"  # type: ignore[index]


def test_tool_calls_are_a_clear_400(engine_a) -> None:
    c = _client(engine_a)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="tool and function calls") as e:
        c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], tools=[tool])
    assert e.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="tool calls are not supported"):
        c.chat.completions.create(model="tiny-llama", messages=[
            {"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model="tiny-llama", prompt="x", logprobs=21)


def test_n_choices_models_and_error_shape(engine_a) -> None:
    c = _client(engine_a)
    r = c.completions.create(model="tiny-llama", prompt="pick", max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    assert len({ch.text for ch in r.choices}) > 1  # seeds seed, seed+1, seed+2: the choices differ
    again = c.completions.create(model="tiny-llama", prompt="pick", max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]
    streamed = list(c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=4, n=2, stream=True))
    assert {ch.choices[0].index for ch in streamed} == {0, 1}
    with pytest.raises(openai.BadRequestError, match="exceeds this engine's limit of 8"):
        c.completions.create(model="tiny-llama", prompt="x", n=9)
    m = c.models.list().data
    assert [x.id for x in m] == ["tiny-llama"] and m[0].owned_by == "kascade" and m[0].created > 0
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="x")
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "model_not_found" and body["param"] == "model"
    assert "model 'nope' is not served" in body["message"]


def test_unknown_routes_are_openai_errors_and_health(engine_a) -> None:  # type: ignore[no-untyped-def]
    import httpx

    r = httpx.get(engine_a.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == 404 and "GET /v1/nothing-here" in err["message"]
    r = httpx.get(engine_a.url + "/v1/completions", timeout=10)  # a POST route
    assert r.status_code == 405 and r.json()["error"]["type"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as e:
        _client(engine_a).post("/embeddings", body={"model": "tiny-llama", "input": "x"}, cast_to=object)
    assert "POST /v1/embeddings" in str(e.value)
    h = httpx.get(engine_a.url + "/health", timeout=10)
    assert h.status_code == 200 and h.content == b""


def test_sampling_parameters(engine_a) -> None:  # type: ignore[no-untyped-def]
    c = _client(engine_a)
    loop = [7] * 8  # a prompt after which greedy output repeats itself

    def toks(**kw):  # type: ignore[no-untyped-def]
        r = c.completions.create(model="tiny-llama", prompt=loop, max_tokens=32, **kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

    greedy = toks()
    assert toks(temperature=1.0, seed=1, extra_body={"top_k": 1}) == greedy  # top_k=1 is greedy
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 5.0}}):
        assert toks(**kw) != greedy and toks(**kw) == toks(**kw), kw  # changed, deterministically
    # the tiny model (seed 0) answers [7] * 8 greedily with 283, 392, 392, ...: 392 as a stop token ends it at 2
    two = c.completions.create(model="tiny-llama", prompt=loop, max_tokens=32, extra_body={"stop_token_ids": [392]})
    assert two.usage.completion_tokens == 2 and two.choices[0].finish_reason == "stop"
    held = c.completions.create(model="tiny-llama", prompt=loop, max_tokens=32,
                                extra_body={"stop_token_ids": [392], "min_tokens": 5})
    assert held.usage.completion_tokens >= 5  # the stop token is masked until 5 tokens are out
    run = c.completions.create(model="tiny-llama", prompt=loop, max_tokens=20, extra_body={"ignore_eos": True})
    assert run.usage.completion_tokens == 20 and run.choices[0].finish_reason == "length"
    chat = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi hi hi"}],
                                     max_tokens=12, frequency_penalty=2.0, extra_body={"top_k": 5, "min_tokens": 3})
    assert chat.usage.completion_tokens >= 3
    for kw, field in (
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 40}}, "min_tokens"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [512]}}, "stop_token_ids"),
        ({"extra_body": {"ignore_eos": "maybe"}}, "ignore_eos"),
    ):
        with pytest.raises(openai.BadRequestError, match=field) as e:
            c.completions.create(model="tiny-llama", prompt=loop, max_tokens=32, **kw)
        assert e.value.body["param"] == field, kw  # type: ignore[index]


def test_request_phase_metrics(engine_a) -> None:  # type: ignore[no-untyped-def]
    """vLLM's per-request histograms: queue, prefill and decode time, prompt length."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(engine_a.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name.startswith("kascade_request_") and s.name.endswith(("_count", "_sum")):
                    out[s.name] = s.value
        return out

    before = scrape()
    c = _client(engine_a)
    for n in (4, 9):
        c.completions.create(model="tiny-llama", prompt=[5] * 10, max_tokens=n, extra_body={"ignore_eos": True})
    after = scrape()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for h in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "prompt_tokens"):
        assert delta(f"kascade_request_{h}_count") == 2, h
    assert delta("kascade_request_prompt_tokens_sum") == 20
    assert 0 <= delta("kascade_request_queue_time_seconds_sum") < delta("kascade_request_decode_time_seconds_sum") + 5
    assert (
        delta("kascade_request_prefill_time_seconds_sum") > 0 and delta("kascade_request_decode_time_seconds_sum") > 0
    )


def test_logprobs(engine_a) -> None:  # type: ignore[no-untyped-def]
    import math

    c = _client(engine_a)
    r = c.completions.create(model="tiny-llama", prompt=[5] * 6, max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 8 == len(lp.tokens) == len(lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    for v, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v)  # greedy: the sampled token is the top one
        assert sum(math.exp(x) for x in top.values()) <= 1 + 1e-5
    plain = c.completions.create(model="tiny-llama", prompt=[5] * 6, max_tokens=8)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text
    streamed = list(c.completions.create(model="tiny-llama", prompt=[5] * 6, max_tokens=8, logprobs=3, stream=True))
    got = [v for ch in streamed if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs)
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)  # greedy picks the top
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    bare = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, logprobs=True)
    assert [e.logprob for e in bare.choices[0].logprobs.content] == pytest.approx([e.logprob for e in content])
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    chunks = list(c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, logprobs=True,
                                            top_logprobs=2, stream=True))
    s = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert s == pytest.approx([e.logprob for e in content])
    sampled = c.completions.create(
        model="tiny-llama", prompt=[5] * 6, max_tokens=8, logprobs=0, temperature=1.0, seed=2
    )
    assert all(v <= 0 for v in sampled.choices[0].logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs") as e:
        c.chat.completions.create(model="tiny-llama", messages=msgs, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", messages=msgs, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"  # type: ignore[index]
