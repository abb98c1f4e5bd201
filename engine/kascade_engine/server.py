"""The HTTP server: OpenAI-compatible completions (streaming SSE), the control API under /kascade/v1/
(bearer token), /metrics, /healthz, /readyz.

Data flow: HTTP body -> pydantic request model (400 naming the field on failure) -> tokenizer ->
`EngineInstance.serving.submit` (serving.py: the engine loop, per-request queues, split requests) ->
JSON or SSE chunks. Routes are thin: the instance owns all state. Nothing a client sends reaches the
loop unchecked, and an exception while serving one request fails only that request.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kascade_engine.control import add_control_routes
from kascade_engine.instance import EngineInstance, InstanceError
from kascade_engine.sampling import SamplingParams
from kascade_engine.serving import RequestError

log = logging.getLogger(__name__)
reqlog = logging.getLogger("kascade_engine.requests")  # one line per request: accepted (in which phase) or rejected


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


def _err(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def create_app(inst: EngineInstance) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        inst.serving.start()
        yield
        await inst.close()

    app = FastAPI(title="kascade engine", lifespan=lifespan)
    name = inst.config.model_name
    created_at = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _err(400, f"invalid field '{loc}': {first.get('msg', 'invalid')}", loc)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _err(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(InstanceError)
    async def on_instance_error(_: Request, exc: InstanceError) -> JSONResponse:
        kind = {401: "authentication_error", 403: "authentication_error", 503: "unavailable"}.get(exc.status,
                                                                                                "invalid_request_error")
        return _err(exc.status, exc.message, exc.field, kind)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _err(exc.status_code, str(exc.detail))

    def check_model(model: str) -> None:
        if model != name:
            raise RequestError(404, f"model '{model}' is not served here (serving '{name}')", "model", "model_not_found")
        try:
            inst.accepting()
        except InstanceError as e:
            # a router or Service sent a request to an engine that is not Ready: the request log shows it
            reqlog.warning("request rejected: phase=%s: %s", inst.phase.value, e.message)
            raise
        m = inst.model
        reqlog.info("request accepted: phase=%s resident=%d/%d", inst.phase.value, m.resident_prefix(), m.shape.layers)

    async def respond(body: _Common, prompt: list[int], chat: bool) -> Response:
        check_model(body.model)
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p, body.seed)
        rid = inst.serving.submit(prompt, params)
        created, obj = int(time.time()), "chat.completion" if chat else "text_completion"
        tok = inst.tokenizer

        def choice(text: str, reason: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}

        if not body.stream:
            out, reason = [], None
            async for ev in inst.serving.tokens(rid):
                out.append(ev.token)
                reason = ev.reason
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": name,
                                 "choices": [choice(tok.decode(out), reason, False)], "usage": usage})

        async def sse() -> AsyncIterator[bytes]:
            out: list[int] = []
            sent = ""
            try:
                async for ev in inst.serving.tokens(rid):
                    out.append(ev.token)
                    text = tok.decode(out)
                    piece, sent = text[len(sent):], text
                    chunk = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                             "model": name, "choices": [choice(piece, ev.reason, True)]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
            except RequestError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created_at, "owned_by": "kascade"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Response:
        prompt = body.prompt if isinstance(body.prompt, list) else inst.tokenizer.encode(body.prompt)
        return await respond(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> Response:
        prompt = inst.tokenizer.chat_prompt([m.model_dump() for m in body.messages])
        return await respond(body, prompt, chat=True)

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz")
    async def readyz() -> PlainTextResponse:
        ok = inst.servable  # serving, or loading while live-paired: what Services and routers may send to
        return PlainTextResponse("ready" if ok else inst.phase.value, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        inst.metrics.update(inst)
        return Response(generate_latest(inst.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_control_routes(app, inst)
    return app


def new_token() -> str:
    return secrets.token_urlsafe(24)
