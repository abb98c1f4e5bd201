"""The OpenAI API as current SDKs use it: request bodies (pydantic, at the boundary), what is refused,
and how generated tokens become choices, chunks and usage.

Supported: `/v1/completions` (prompt: text, token ids, or a list of either) and `/v1/chat/completions`
(roles system, developer, user, assistant; content as a string or text parts), `n` (up to the
engine's --max-n), `stop` (up to 4 strings, matched on the decoded text, never streamed past),
`max_tokens` / `max_completion_tokens` (chat default: whatever fits in the context), `seed`,
`temperature`, `top_p`, `presence_penalty`, `frequency_penalty`, and vLLM's `top_k`, `min_tokens`,
`ignore_eos`, `repetition_penalty`, `stop_token_ids`; `logprobs` (completions: int) or `logprobs` + `top_logprobs`
(chat); `stream` with `stream_options.include_usage`. `usage` on every non-streamed
response. Fields that would change the result and are not implemented (tools,
logit_bias, echo, best_of, suffix, non-text content, json response formats) are a 400 naming the field,
never silently ignored.

Data flow: body -> `refused(body)` -> prompts (token ids) -> one engine request per (prompt, n) ->
`Choice` per request: tokens -> text with stop strings and incomplete UTF-8 held back -> JSON or SSE.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kascade_engine.http.detokenizer import Detokenizer

MAX_STOP = 4
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default cap; OpenAI's is 5 for completions, 20 for chat)


def logprob_count(body: _Common) -> int | None:
    """How many top alternatives per token the request asked for; None: no logprobs."""
    if isinstance(body, ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    return None if body.logprobs is None or isinstance(body.logprobs, bool) else body.logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's extra sampling parameters (the openai client sends them in extra_body)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    logit_bias: dict[str, float] | None = None

    def stops(self) -> tuple[str, ...]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(x for x in s if x)


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None


def refused(body: _Common, max_n: int) -> tuple[str, str] | None:
    """(field, message) for a request this engine must not pretend to serve, else None."""
    if (body.n or 1) > max_n:
        return "n", f"n = {body.n} exceeds this engine's limit of {max_n}"
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP:
        return "stop", f"at most {MAX_STOP} stop strings, got {len(stops)}"
    if isinstance(body, CompletionBody) and body.logprobs is not None and (
            isinstance(body.logprobs, bool) or not 0 <= body.logprobs <= MAX_LOGPROBS):
        return "logprobs", f"an int in 0..{MAX_LOGPROBS} (top alternatives per token), got {body.logprobs!r}"
    if body.logit_bias:
        return "logit_bias", "logit_bias is not supported by this engine"
    if isinstance(body, CompletionBody):
        if body.echo:
            return "echo", "echo is not supported by this engine"
        if (body.best_of or 1) > 1:
            return "best_of", "best_of > 1 is not supported by this engine"
        if body.suffix:
            return "suffix", "suffix (insertion) is not supported by this engine"
    if isinstance(body, ChatBody):
        tool_choice = body.tool_choice if body.tool_choice != "none" else None
        for f, v in (("tools", body.tools), ("tool_choice", tool_choice), ("functions", body.functions),
                     ("function_call", body.function_call)):
            if v:
                return f, f"{f}: tool and function calls are not supported by this engine"
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            return "logprobs", f"a boolean for chat (top_logprobs says how many alternatives), got {body.logprobs!r}"
        if body.top_logprobs is not None:
            if not body.logprobs:
                return "top_logprobs", "top_logprobs needs logprobs: true"
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                return "top_logprobs", f"an int in 0..{MAX_LOGPROBS}, got {body.top_logprobs}"
        if body.response_format and body.response_format.get("type", "text") != "text":
            return (
                "response_format",
                f"response_format {body.response_format.get('type')!r} is not supported (text only)",
            )
        for i, m in enumerate(body.messages):
            if m.role == "tool" or m.tool_calls:
                return (f"messages.{i}.role" if m.role == "tool" else f"messages.{i}.tool_calls",
                        "tool calls are not supported by this engine")
            if isinstance(m.content, list):
                for j, p in enumerate(m.content):
                    if p.type != "text" or p.text is None:
                        return (
                            f"messages.{i}.content.{j}.type",
                            f"content part type {p.type!r} is not supported (text only)",
                        )
    return None


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """Messages as chat templates expect them: developer is system; text parts joined."""
    out = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text or "" for p in (m.content or []))
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


class TextStop:
    """Decoded text of one choice, released only where no stop string can still begin and no UTF-8
    character is incomplete; finds the first stop string. Per token it decodes a short tail window
    (`Detokenizer`) and searches only the held-back text plus the new piece, so its cost does not grow
    with the length of the generation."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...],
                 hold: Collection[int] = ()) -> None:
        self.detok = Detokenizer(decode, hold)
        self.stops = stops
        self.released: list[str] = []
        self.sent = 0  # characters released
        self.held = ""  # decoded text held back: it may begin a stop string
        self.stopped = False

    @property
    def tokens(self) -> list[int]:
        return self.detok.tokens

    def feed(self, token: int, last: bool) -> str:
        """The text this token releases (possibly empty); after a stop string, `stopped` is set."""
        buf = self.held + self.detok.push(token, last)
        cut = None
        for s in self.stops:  # a stop string cannot begin in released text: its prefix would be held
            i = buf.find(s)
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            return self._release(buf[:cut], "")
        hold = 0
        if not last:
            for s in self.stops:  # a suffix that may begin a stop string is held back
                for k in range(min(len(s) - 1, len(buf)), 0, -1):
                    if buf.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        return self._release(buf[:len(buf) - hold], buf[len(buf) - hold:])

    def _release(self, piece: str, held: str) -> str:
        self.held = held
        self.released.append(piece)
        self.sent += len(piece)
        return piece

    @property
    def text(self) -> str:
        """Released text, plus what is still held back unless a stop string ended the choice."""
        return "".join(self.released) + ("" if self.stopped else self.held)
