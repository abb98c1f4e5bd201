"""The HTTP server: OpenAI-compatible completions (streaming SSE), the control API under /kascade/v1/
(bearer token), /metrics, /healthz and /health (vLLM's), /readyz; unknown routes get OpenAI's error shape.

Data flow: HTTP body -> pydantic request model (openai_api.py; 400 naming the field on failure, and
for fields this engine does not implement) -> tokenizer -> context check -> `responder.Call` (one
engine request per prompt x n via `EngineInstance.serving`) -> JSON or SSE chunks. Routes are thin: the instance owns
all state. Nothing a client sends reaches the
loop unchecked, and an exception while serving one request fails only that request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kascade_engine.http.control import add_control_routes
from kascade_engine.http.httpguard import BodyLimit
from kascade_engine.http.openai_api import ChatBody, CompletionBody, _Common, chat_messages, refused
from kascade_engine.http.responder import Call
from kascade_engine.instance import EngineInstance
from kascade_engine.refusal import InstanceError
from kascade_engine.serving import RequestError, handed_back
from kascade_planner.engine_api import (
    HANDED_BACK_HEADER,
    PREFILL_FALLBACK_HEADER,
    PREFILL_HEADER,
    PREFILL_RATE_HEADER,
    PREFILL_ROOM_HEADER,
    PREFILL_SIG_HEADER,
    SERVING_SHARE_HEADER,
    HandedBack,
    prefill_signature,
)
from kascade_planner.loadwatch import TICK_S, LoadWatch, WindowRate

log = logging.getLogger(__name__)
reqlog = logging.getLogger("kascade_engine.requests")  # one line per request: accepted (in which phase) or rejected


def _err(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def create_app(inst: EngineInstance) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        inst.serving.start()
        yield
        await inst.close()

    # No /docs, /redoc or /openapi.json: they would publish the control API's schema without a token.
    app = FastAPI(title="kascade engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit)  # body size and time bounds before any route (httpguard.py)
    created_at = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _err(400, f"invalid field '{loc}': {first.get('msg', 'invalid')}", loc)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        r = _err(exc.status, exc.message, exc.param, exc.kind)
        if exc.retry_after_s is not None:
            r.headers["Retry-After"] = str(exc.retry_after_s)
        return r

    @app.exception_handler(InstanceError)
    async def on_instance_error(_: Request, exc: InstanceError) -> JSONResponse:
        kind = {401: "authentication_error", 403: "authentication_error", 503: "unavailable"}.get(exc.status,
                                                                                                "invalid_request_error")
        return _err(exc.status, exc.message, exc.field, kind)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # OpenAI clients parse every error body: an unknown route or method is OpenAI-shaped too, naming it
        if exc.status_code == 404:
            return _err(404, f"no route {request.method} {request.url.path} on this engine", None, "not_found_error")
        if exc.status_code == 405:
            return _err(405, f"method {request.method} is not allowed on {request.url.path}", None,
                        "method_not_allowed")
        return _err(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a bug, not the client's fault: starlette still logs its traceback (and re-raises it past this answer to
        # the server); the client, and the router relaying the answer, get an OpenAI-shaped error naming it, not
        # a plain-text "Internal Server Error" that every OpenAI client reports as a bare "Error code: 500"
        return _err(500, f"engine failed on this request: {type(exc).__name__}: {exc}", None, "server_error")

    def check_model(model: str) -> None:
        name = inst.config.model_name  # read per request: a released engine may switch model (switch_model)
        if model != name:
            raise RequestError(
                404, f"model '{model}' is not served here (serving '{name}')", "model", "model_not_found"
            )
        try:
            inst.accepting()
        except InstanceError as e:
            # a router or Service sent a request to an engine that is not Ready: the request log shows it
            reqlog.warning("request rejected: phase=%s: %s", inst.phase.value, e.message)
            raise
        m = inst.model
        reqlog.info("request accepted: phase=%s resident=%d/%d", inst.phase.value, m.resident_prefix(), m.shape.layers)

    async def respond(request: Request, body: _Common, prompts: list[list[int]]) -> Response:
        check_model(body.model)
        bad = refused(body, inst.config.max_n) or unusable_sampling(body)
        if bad is not None:
            raise RequestError(400, f"invalid field '{bad[0]}': {bad[1]}", bad[0])
        ctx = inst.context_len
        longest = max(len(p) for p in prompts)
        if longest >= ctx:
            raise RequestError(400, f"prompt has {longest} tokens, the context holds {ctx}", "prompt")
        field = "max_tokens"
        if isinstance(body, ChatBody):
            if body.max_completion_tokens is not None:
                field = "max_completion_tokens"
            want = body.max_completion_tokens or body.max_tokens or ctx - longest  # default: what fits
        else:
            want = body.max_tokens or 16  # OpenAI's completions default
        vocab = inst.model.shape.vocab
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise RequestError(400, f"invalid field 'stop_token_ids': token ids must be in 0..{vocab - 1}",
                               "stop_token_ids")
        if (body.min_tokens or 0) > want:
            raise RequestError(400, f"invalid field 'min_tokens': {body.min_tokens} exceeds {field} ({want})",
                               "min_tokens")
        if longest + want > ctx:
            raise RequestError(400, f"prompt ({longest} tokens) + {field} ({want}) exceeds the context of {ctx} "
                               "tokens", field)
        pre, fallback = prefill_peer(request), peer_header(request, PREFILL_FALLBACK_HEADER)
        if (pre or fallback) and inst.config.require_prefill_signature:
            check_prefill_signature(request, inst.config.token, pre, fallback)
        call = Call(inst, body, prompts, want, pre, fallback)
        watched = inst.serving.watched(call.rids)  # prompts that may be prefilled elsewhere than the router said
        if not body.stream:
            doc = await until_client_leaves(request, call.json())
            handed = await handed_back(watched)  # settled by now: every prompt got its tokens
            return JSONResponse(doc, headers=answer_headers(inst, handed))
        handed = None
        if watched:
            # the answer (its headers) starts once each is settled (Serving.decisions: a hand-back's op went out,
            # the prompt is to be prefilled here, or its first token came), so it names who prefills the prompt when
            # that is not the engine the router said, and the router counts and times it there from then
            try:
                handed = await until_client_leaves(request, handed_back(watched))
            except RequestError:
                for rid in call.rids:
                    inst.serving.abort(rid)
                raise
        return StreamingResponse(call.sse(), media_type="text/event-stream", headers=answer_headers(inst, handed))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": inst.config.model_name, "object": "model", "created": created_at, "owned_by": "kascade"}],
        }

    # Tokenizing runs in a worker thread: a large prompt must not stall /healthz and every stream.
    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody) -> Response:
        p = body.prompt
        if isinstance(p, str):
            prompts = [await asyncio.to_thread(inst.tokenizer.encode, text_field(p, "prompt"))]
        elif p and isinstance(p[0], str):
            texts = [text_field(str(x), "prompt") for x in p]
            prompts = await asyncio.to_thread(lambda: [inst.tokenizer.encode(x) for x in texts])
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]  # type: ignore[arg-type]
        return await respond(request, body, prompts)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatBody) -> Response:
        bad = refused(body, inst.config.max_n)  # before the template sees unsupported content
        if bad is not None:
            raise RequestError(400, f"invalid field '{bad[0]}': {bad[1]}", bad[0])
        messages = chat_messages(body)
        for m in messages:
            text_field(str(m.get("content") or ""), "messages")
        return await respond(request, body, [await asyncio.to_thread(inst.tokenizer.chat_prompt, messages)])

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)  # vLLM's liveness: the process answers (readiness is /readyz)

    @app.get("/readyz")
    async def readyz() -> PlainTextResponse:
        ok = inst.servable  # serving, or loading while live-paired: what Services and routers may send to
        # the share routers weight a live replica by, also between its answers (kascade_router.shares)
        return PlainTextResponse("ready" if ok else inst.phase.value, status_code=200 if ok else 503,
                                 headers={SERVING_SHARE_HEADER: f"{inst.serving_share:.4f}", **rate_header(inst)})

    prompt_rate = WindowRate()  # sampled while a load watch is held (kascade_planner.loadwatch)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            watch = LoadWatch.from_query(request.query_params)
        except ValueError as e:
            return PlainTextResponse(f"load watch: {e}\n", status_code=400)
        if watch is not None:  # held until prompt tokens/s leaves the band, or the wait is over
            end = time.monotonic() + watch.wait_s
            while True:
                prompt_rate.add(time.monotonic(), inst.metrics.prompt_total)
                if watch.left(prompt_rate.rate(watch.window_s)) or time.monotonic() >= end:
                    break
                await asyncio.sleep(TICK_S)
        inst.metrics.update(inst)
        return Response(generate_latest(inst.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_control_routes(app, inst)
    return app


MIN_SAMPLING = 1e-3  # temperature/top_p above 0 but below this overflow or vanish in float32 logits


def unusable_sampling(body: _Common) -> tuple[str, str] | None:
    """(field, message) for sampling values torch cannot honour (a 500, or a ghost request, before)."""
    if body.seed is not None and not 0 <= body.seed < 2**64:
        return "seed", f"seed must be within [0, 2^64), got {body.seed}"
    if body.temperature is not None and 0 < body.temperature < MIN_SAMPLING:
        return "temperature", f"must be 0 (greedy) or at least {MIN_SAMPLING}, got {body.temperature}"
    if body.top_p is not None and body.top_p < MIN_SAMPLING:
        return "top_p", f"must be at least {MIN_SAMPLING}, got {body.top_p}"
    return None


def text_field(text: str, field: str) -> str:
    """`text` if it is valid Unicode (a lone surrogate such as \\ud800 is valid JSON but no text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"invalid field '{field}': not valid Unicode text at character {e.start} "
                                f"({e.reason})", field) from None
    return text


async def until_client_leaves(request: Request, work: Any) -> Any:
    """Await `work` (a non-streaming response body); if the client disconnects first, cancel it (which
    aborts its engine requests) instead of generating for nobody."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RequestError(499, "client closed the request", None)
    return task.result()


def rate_header(inst: EngineInstance) -> dict[str, str]:
    """PREFILL_RATE_HEADER once the engine measured its prefill rate: routers weigh a converted decoder by it
    against a prefill engine's (the prefill engine's comes from /readyz: a router's PD requests go to decoders)."""
    rate = inst.engine.meter.prefill_rate()
    return {} if rate is None else {PREFILL_RATE_HEADER: f"{rate:.1f}"}


def load_headers(inst: EngineInstance) -> dict[str, str]:
    """An answer's headers about this engine's load, built when the answer starts: its serving share, a converted
    decoder's prefill room, the prefill rate. A router takes a missing room or rate for "none now", so an answer
    held back until its prompt was settled (a hand-back) must not carry what was true at its arrival: built then,
    it cleared the rate the router had polled since, and the router sent the decoder its next prompt at the
    constant share 27-105 ms later (bench/pd.py)."""
    out = {SERVING_SHARE_HEADER: f"{inst.serving_share:.4f}"}  # routers weight a live replica by it
    room = inst.engine.scheduler.prefill_room()
    if room is not None:  # a converted decoder: routers send it prompts only while it has room
        out[PREFILL_ROOM_HEADER] = str(room)
    return {**out, **rate_header(inst)}


def answer_headers(inst: EngineInstance, handed: HandedBack | None) -> dict[str, str]:
    """An answer's headers, built as it starts (the router replaces what it knew with these): `load_headers`,
    and HANDED_BACK_HEADER naming who prefills a prompt when not the engine the router said."""
    out = load_headers(inst)
    if handed is not None:
        out[HANDED_BACK_HEADER] = handed.header()
    return out


def prefill_peer(request: Request) -> str | None:
    """The prefill engine the router chose for this request (disaggregated serving), if any. Only the
    router sets it (it never forwards clients' headers); the peer must still pass the data-port hello."""
    return peer_header(request, PREFILL_HEADER)


def check_prefill_signature(request: Request, token: str, pre: str | None, fallback: str | None) -> None:
    """--require-prefill-signature: the peers a request names must carry a router's signature (403 otherwise:
    nothing is dialled)."""
    sig = request.headers.get(PREFILL_SIG_HEADER, "")
    if not hmac.compare_digest(sig.encode(), prefill_signature(token, pre, fallback).encode()):
        name = PREFILL_HEADER if pre else PREFILL_FALLBACK_HEADER
        raise RequestError(403, f"header '{name.lower()}': not signed by a router holding the engine token "
                                f"('{PREFILL_SIG_HEADER.lower()}' {'wrong' if sig else 'missing'})", name.lower(),
                           kind="permission_error")


def peer_header(request: Request, name: str) -> str | None:
    """A data-port address (host:port) the router put in header `name` (PREFILL_HEADER, or
    PREFILL_FALLBACK_HEADER: where a converted decoder hands a prompt it has no room for), if any."""
    peer = request.headers.get(name)
    if not peer:
        return None
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RequestError(400, f"header '{name.lower()}' = {peer!r}: expected host:port", name.lower())
    return peer


def new_token() -> str:
    return secrets.token_urlsafe(24)
