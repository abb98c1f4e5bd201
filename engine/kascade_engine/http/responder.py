"""One OpenAI call in flight: its engine requests (one per prompt x n) and the response built from their
tokens — a JSON body, or SSE chunks merged from every choice as they come.

Data flow: `Call(...)` submits every request at once (a refusal aborts the ones already submitted and
raises before any byte is sent) -> per choice: `Serving.tokens(rid)` -> `TextStop` (stop strings,
incomplete UTF-8) -> `json()` (usage always) or `sse()` (role chunk, one chunk per token, finish
chunk, usage chunk with `stream_options.include_usage`, `[DONE]`). A client that goes away cancels the
choice tasks, which abort their requests and free their KV pages at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.http.logprobs import ChoiceLogprobs
from kascade_engine.http.openai_api import ChatBody, TextStop, _Common, logprob_count
from kascade_engine.serving import RequestError

if TYPE_CHECKING:
    from kascade_engine.instance import EngineInstance

Emit = Callable[[int, str, "str | None", "dict[str, Any] | None"], None]  # index, text, finish, logprob entry


class Call:
    def __init__(self, inst: EngineInstance, body: _Common, prompts: list[list[int]], max_tokens: int,
                 prefill: str | None = None, fallback: str | None = None) -> None:
        self.inst, self.body, self.prompts = inst, body, prompts
        self.chat = isinstance(body, ChatBody)
        self.created = int(time.time())
        self.stops = body.stops()
        n = body.n or 1
        self.lp_k = logprob_count(body)
        self.rids: list[str] = []
        try:
            for p in prompts:
                for j in range(n):
                    seed = None if body.seed is None else body.seed + j  # n choices differ, each reproducible
                    params = SamplingParams(max_tokens, body.temperature or 0.0,
                                            1.0 if body.top_p is None else body.top_p, seed,
                                            top_k=max(body.top_k or 0, 0), min_tokens=body.min_tokens or 0,
                                            ignore_eos=bool(body.ignore_eos),
                                            repetition_penalty=body.repetition_penalty or 1.0,
                                            frequency_penalty=body.frequency_penalty or 0.0,
                                            presence_penalty=body.presence_penalty or 0.0,
                                            stop_token_ids=tuple(body.stop_token_ids or ()),
                                            logprobs=self.lp_k)
                    self.rids.append(inst.serving.submit(p, params, prefill, fallback))
        except Exception:
            for rid in self.rids:
                inst.serving.abort(rid)
            raise
        self.id = self.rids[0].replace("cmpl-", "chatcmpl-" if self.chat else "cmpl-")
        self.completion_tokens = [0] * len(self.rids)
        self.lps = [ChoiceLogprobs(inst.tokenizer.decode, self.chat) for _ in self.rids]

    async def _choice(self, idx: int, emit: Emit) -> tuple[str, str]:
        serving, rid = self.inst.serving, self.rids[idx]
        ts = TextStop(self.inst.tokenizer.decode, self.stops, getattr(self.inst.tokenizer, "byte_tokens", ()))
        reason = "length"
        async with aclosing(serving.tokens(rid)) as events:
            async for ev in events:
                self.completion_tokens[idx] += 1
                piece = ts.feed(ev.token, ev.finished)
                entry = None if ev.logprob is None or self.lp_k is None else self.lps[idx].add(ev.token, ev.logprob)
                if ts.stopped:
                    reason = "stop"
                    serving.stop(rid)  # a stop string: the request ends here, its pages are freed
                    emit(idx, piece, reason, entry)
                    break
                if ev.finished:
                    reason = ev.reason or "stop"
                emit(idx, piece, reason if ev.finished else None, entry)
        return ts.text, reason

    def _lp(self, i: int) -> dict[str, Any] | None:
        return None if self.lp_k is None else self.lps[i].doc(self.lps[i].entries)

    def usage(self) -> dict[str, int]:
        p, c = sum(len(x) for x in self.prompts), sum(self.completion_tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.inst.config.model_name}

    async def json(self) -> dict[str, Any]:
        try:
            results = await asyncio.gather(*(self._choice(i, lambda *_: None) for i in range(len(self.rids))))
        except BaseException:
            for rid in self.rids:
                self.inst.serving.abort(rid)
            raise
        choices = []
        for i, (text, reason) in enumerate(results):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                                "finish_reason": reason, "logprobs": self._lp(i)})
            else:
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": self._lp(i)})
        return {**self._head(False), "choices": choices, "usage": self.usage(), "system_fingerprint": None}

    async def sse(self) -> AsyncIterator[bytes]:
        q: asyncio.Queue[tuple[int, str, str | None, dict[str, Any] | None] | BaseException | None] = asyncio.Queue()
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        async def run(i: int) -> None:
            try:
                await self._choice(i, lambda idx, piece, reason, lp: q.put_nowait((idx, piece, reason, lp)))
            except BaseException as e:
                q.put_nowait(e)
            finally:
                q.put_nowait(None)

        def data(doc: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(doc)}\n\n".encode()

        tasks = [asyncio.create_task(run(i)) for i in range(len(self.rids))]
        try:
            if self.chat:
                for i in range(len(self.rids)):
                    yield data(
                        {
                            **self._head(True),
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                    "logprobs": None,
                                }
                            ],
                            **extra,
                        }
                    )
            live = len(tasks)
            while live:
                item = await q.get()
                if item is None:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    msg = item.message if isinstance(item, RequestError) else str(item)
                    yield data({"error": {"message": msg, "type": "server_error", "param": None, "code": 500}})
                    continue
                i, piece, reason, entry = item
                lp = None if entry is None else self.lps[i].doc([entry])
                if self.chat:
                    choice = {"index": i, "delta": {"content": piece} if piece or reason is None else {},
                              "finish_reason": reason, "logprobs": lp}
                else:
                    choice = {"index": i, "text": piece, "finish_reason": reason, "logprobs": lp}
                yield data({**self._head(True), "choices": [choice], **extra})
            if include_usage:
                yield data({**self._head(True), "choices": [], "usage": self.usage()})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
