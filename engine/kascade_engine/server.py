"""The HTTP server: OpenAI-compatible completions (streaming SSE), the control API under /kascade/v1/
(bearer token), /metrics, /healthz, /readyz.

Data flow: HTTP body -> pydantic request model (400 naming the field on failure) -> tokenizer ->
`Engine.submit` -> the engine loop task runs `Engine.step` in a worker thread and routes `Event`s to
per-request asyncio queues -> JSON or SSE chunks. Nothing a client sends reaches the loop unchecked,
and an exception while serving one request fails only that request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kascade_engine.engine import Engine, Event
from kascade_engine.live import Finisher
from kascade_engine.metrics import EngineMetrics
from kascade_engine.sampling import SamplingParams
from kascade_engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Common):
    prompt: str | list[int]


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    token: str
    instance: str = "engine-0"
    max_prompt_tokens: int = 2048
    finisher: Finisher | None = None
    role: str = "colocated"
    model_service: str | None = None
    phase: str = "ready"
    cooperate: dict[str, str] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    bytes_received: int = 0
    transfer_bw: float = 0.0
    blockset: Any = None  # the BlockSet this engine started with (sources send from it)
    transport: str = "tcp"  # weight data plane: tcp or ucx
    transfer_bytes_per_s: float | None = None  # cap on weight data sent (None: line rate)
    loading: asyncio.Task[None] | None = None
    load_error: str | None = None
    split_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    queues: dict[str, asyncio.Queue[Event | Exception]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


async def _engine_loop(st: ServerState) -> None:
    last_token: dict[str, float] = {}
    while True:
        if st.engine.scheduler.idle:
            st.wake.clear()
            await st.wake.wait()
        try:
            events = await asyncio.to_thread(st.engine.step)
        except Exception as e:  # one failing step fails its requests, never the loop
            log.exception("engine step failed")
            for rid, q in list(st.queues.items()):
                st.engine.abort(rid)
                q.put_nowait(e)
            continue
        now = time.monotonic()
        for ev in events:
            prev = last_token.get(ev.request)
            st.metrics.observe_token(prev, now, st.engine)
            last_token[ev.request] = now
            if ev.finished:
                last_token.pop(ev.request, None)
            q = st.queues.get(ev.request)
            if q is not None:
                q.put_nowait(ev)
        st.metrics.update(st)


def _err(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def create_app(st: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_engine_loop(st))
        yield
        task.cancel()

    app = FastAPI(title="kascade engine", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _err(400, f"invalid field '{loc}': {first.get('msg', 'invalid')}", loc)

    @app.exception_handler(ApiError)
    async def on_api(_: Request, exc: ApiError) -> JSONResponse:
        return _err(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _err(exc.status_code, str(exc.detail))

    def check_model(name: str) -> None:
        if name != st.model_name:
            raise ApiError(404, f"model '{name}' is not served here (serving '{st.model_name}')", "model", "model_not_found")
        if st.phase in ("draining", "idle"):
            raise ApiError(503, f"engine is {st.phase}; not accepting requests", None, "unavailable")
        m = st.engine.model
        if not m.complete and not (st.cooperate and m.resident("embed")):
            raise ApiError(503, f"engine is loading ({m.resident_prefix()}/{m.shape.layers} layers resident)", None, "unavailable")

    def submit(body: _Common, prompt: list[int]) -> tuple[str, asyncio.Queue[Event | Exception]]:
        if not st.engine.model.complete:
            return submit_split(body, prompt)
        if len(prompt) > st.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(prompt)} tokens, the limit is {st.max_prompt_tokens}", "prompt")
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        vocab = st.engine.model.shape.vocab
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p, body.seed)
        try:
            rid = st.engine.submit(prompt, params, f"cmpl-{uuid.uuid4().hex[:16]}")
        except ValueError as e:
            raise ApiError(400, str(e), "max_tokens") from None
        q: asyncio.Queue[Event | Exception] = asyncio.Queue()
        st.queues[rid] = q
        st.metrics.input_tokens.inc(len(prompt))
        st.wake.set()
        return rid, q

    def submit_split(body: _Common, prompt: list[int]) -> tuple[str, asyncio.Queue[Event | Exception]]:
        """Live cooperation while loading: our resident prefix here, the rest on the peer (see live.py)."""
        from kascade_engine.live import SplitClient
        from kascade_engine.transport_tcp import TcpTransport

        if len(prompt) > st.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(prompt)} tokens, the limit is {st.max_prompt_tokens}", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        q: asyncio.Queue[Event | Exception] = asyncio.Queue()
        st.queues[rid] = q
        k = st.engine.model.resident_prefix()
        host, _, port = st.cooperate["peer"].rpartition(":")
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p, body.seed)

        async def run() -> None:
            try:
                conn = await TcpTransport().connect(host, int(port))
                try:
                    def emit(tok: int, last: bool) -> None:
                        reason = ("stop" if tok == st.tokenizer.eos_token_id else "length") if last else None
                        q.put_nowait(Event(rid, tok, last, reason))

                    st.metrics.live_split.inc()
                    client = SplitClient(st.engine.model, conn)
                    await client.hello(st.token)  # peers are engines of this installation (same token)
                    await client.generate(rid, prompt, params, k, st.tokenizer.eos_token_id, emit,
                                          zigzag=st.cooperate.get("mode") == "zigzag")
                finally:
                    await conn.close()
            except Exception as e:
                q.put_nowait(e)

        st.split_tasks.add(t := asyncio.create_task(run()))
        t.add_done_callback(st.split_tasks.discard)
        return rid, q

    async def tokens(rid: str, q: asyncio.Queue[Event | Exception]) -> AsyncIterator[Event]:
        t0, first = time.monotonic(), True
        try:
            while True:
                ev = await q.get()
                if first and not isinstance(ev, Exception):
                    st.metrics.observe_ttft(time.monotonic() - t0)
                    first = False
                if isinstance(ev, Exception):
                    raise ApiError(500, f"engine failed on this request: {ev}", None, "server_error")
                if ev.token < 0:
                    raise ApiError(500, f"engine failed on this request: {ev.reason}", None, "server_error")
                yield ev
                if ev.finished:
                    return
        finally:
            st.queues.pop(rid, None)
            if rid in st.engine.requests:  # the client went away mid-generation: free its slot
                st.engine.abort(rid)
                st.wake.set()

    async def respond(body: _Common, prompt: list[int], chat: bool) -> Response:
        check_model(body.model)
        rid, q = submit(body, prompt)
        created, obj = int(time.time()), "chat.completion" if chat else "text_completion"

        def choice(text: str, reason: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}

        if not body.stream:
            out, reason = [], None
            async for ev in tokens(rid, q):
                out.append(ev.token)
                reason = ev.reason
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": st.model_name,
                                 "choices": [choice(st.tokenizer.decode(out), reason, False)], "usage": usage})

        async def sse() -> AsyncIterator[bytes]:
            out: list[int] = []
            sent = ""
            try:
                async for ev in tokens(rid, q):
                    out.append(ev.token)
                    text = st.tokenizer.decode(out)
                    piece, sent = text[len(sent):], text
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                             "model": st.model_name, "choices": [choice(piece, ev.reason, True)]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
            except ApiError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "owned_by": "kascade"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Response:
        prompt = body.prompt if isinstance(body.prompt, list) else st.tokenizer.encode(body.prompt)
        return await respond(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> Response:
        prompt = st.tokenizer.chat_prompt([m.model_dump() for m in body.messages])
        return await respond(body, prompt, chat=True)

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz")
    async def readyz() -> PlainTextResponse:
        ok = st.phase == "ready" and st.engine.model.complete
        return PlainTextResponse("ready" if ok else st.phase, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        st.metrics.update(st)
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    from kascade_engine.control import add_control_routes

    add_control_routes(app, st, ApiError)
    return app


def new_token() -> str:
    return secrets.token_urlsafe(24)
