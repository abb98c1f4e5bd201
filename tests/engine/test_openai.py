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
        c.completions.create(model="tiny-llama", prompt="x", logprobs=2)


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
