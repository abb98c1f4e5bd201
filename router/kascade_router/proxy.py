"""The hot path: one OpenAI request in, one engine's answer out (streamed through as it arrives).

Data flow: body (<= max_body_bytes, else 413) -> JSON object with a string `model` (else 400 naming
it) -> `Routes.lookup` (unknown model: 404 naming it) -> `balancer.pick` among serving backends, or
held until one appears (bounded queue: 429; timeout: 503, both with Retry-After) -> POST to the engine
with the request id -> non-streaming: the body is relayed; streaming: every chunk is written to the
client as soon as it arrives. A replica that fails before any byte reached the client (refused
connection, 503 from a draining engine, closed before its first chunk) is excluded and another is
tried; a failure mid-stream ends that response with an SSE error event. A client that goes away
cancels the handler, which closes the engine connection, which aborts the generation there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kascade_planner.engine_api import SERVING_SHARE_HEADER
from kascade_router.backends import Backend, Routes
from kascade_router.balancer import pick, pick_pd
from kascade_router.demand import Demand, ModelDemand
from kascade_router.settings import RouterSettings

log = logging.getLogger(__name__)
REQUEST_ID = "X-Request-Id"
REPLICA = "X-Kascade-Replica"  # which pod answered (clients, tests and logs can tell)
PREFILL = "X-Kascade-Prefill"  # to a decode engine: host:port of the prefill engine's data port (PD)
PREFILLED_BY = "X-Kascade-Prefilled-By"  # to the client: which prefill pod the router chose
_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SSE = "text/event-stream"
_SKIP = ("User-Agent", "Accept", "Accept-Encoding")  # the engine ignores them: fewer bytes and header work per request


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          rid: str = "", retry_after: int | None = None) -> web.Response:
    headers = {REQUEST_ID: rid} if rid else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


class _Retry(Exception):
    """This replica failed before any byte reached the client: try another."""


def prompt_tokens(doc: dict[str, Any]) -> int:
    """Token ids are counted; text is estimated at 4 characters a token (the router has no tokenizer)."""
    p = doc.get("prompt")
    if isinstance(p, list):
        return len(p)
    if isinstance(p, str):
        return max(1, len(p) // 4)
    msgs = doc.get("messages")
    if isinstance(msgs, list):
        return max(1, sum(len(str(m.get("content", ""))) for m in msgs if isinstance(m, dict)) // 4)
    return 0


class Proxy:
    def __init__(self, routes: Routes, demand: Demand, settings: RouterSettings, session: aiohttp.ClientSession,
                 seed: int | None = None) -> None:
        self.routes, self.demand, self.s, self.session = routes, demand, settings, session
        self.rng = random.Random(seed)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(REQUEST_ID, "")
        if not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        if request.content_length is not None and request.content_length > self.s.max_body_bytes:
            return error(413, f"request body is {request.content_length} bytes, the limit is "
                              f"{self.s.max_body_bytes}", None, rid=rid)
        try:
            body = await request.content.read(self.s.max_body_bytes + 1)
        except (aiohttp.ClientError, ConnectionError) as e:
            return error(400, f"could not read the request body: {e}", None, rid=rid)
        if len(body) > self.s.max_body_bytes:
            return error(413, f"request body exceeds the limit of {self.s.max_body_bytes} bytes", None, rid=rid)
        try:
            doc = json.loads(body)
        except ValueError as e:
            return error(400, f"malformed JSON body: {e}", None, rid=rid)
        if not isinstance(doc, dict):
            return error(400, "the request body must be a JSON object", None, rid=rid)
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return error(400, "field 'model' is required and must be a non-empty string", "model", rid=rid)
        svc = self.routes.lookup(model)
        if svc is None:
            known = ", ".join(sorted(self.routes.models)) or "none"
            return error(404, f"model '{model}' is not served here (known models: {known})", "model",
                         "model_not_found", rid=rid)
        d = self.demand.of(svc, model)
        now = time.monotonic()
        d.arrived(now)
        stream = doc.get("stream") is True
        status, out_tokens = 500, 0
        d.in_flight += 1
        try:
            resp, status, out_tokens = await self._route(request, body, svc, d, stream, rid, now)
            return resp
        except asyncio.CancelledError:
            status = 499  # the client went away (handler cancellation)
            raise
        except ConnectionError:
            status = 499  # the client went away while we wrote to it
            return web.Response(status=499)
        finally:
            d.in_flight -= 1
            d.finished(status, prompt_tokens(doc), out_tokens, time.monotonic())

    async def _route(self, request: web.Request, body: bytes, svc: tuple[str, str], d: ModelDemand, stream: bool,
                     rid: str, t0: float) -> tuple[web.StreamResponse, int, int]:
        tried: set[str] = set()
        deadline = t0 + self.s.hold_timeout_s
        held, tries = False, 0
        while tries < self.s.attempts:
            b, pre = pick_pd(self.routes.serving(svc), self.rng, tried)
            if b is None:
                if not held and d.queued >= self.s.max_queued:
                    return error(429, f"{d.queued} requests for model '{d.model}' are already waiting for a "
                                      f"serving replica (limit {self.s.max_queued})", None, "rate_limit_exceeded",
                                 rid, self.s.retry_after_s), 429, 0
                b = await self._hold(svc, d, tried, deadline)
                held = True
                if b is not None:
                    b, pre = pick_pd(self.routes.serving(svc), self.rng, tried)
                if b is None:
                    why = (f"replicas of model '{d.model}' failed before answering ({tries} tries)" if tries
                           else f"no serving replica of model '{d.model}' (ModelService {svc[0]}/{svc[1]}) "
                                f"within {self.s.hold_timeout_s:g} s; it may be scaling from zero")
                    return error(503, why, None, "unavailable", rid, self.s.retry_after_s), 503, 0
            tried.add(b.pod)
            tries += 1
            try:
                return await self._forward(request, body, b, stream, rid, pre)
            except _Retry as e:
                log.info("request %s: %s; retrying on another replica", rid, e)
        return error(502, f"{tries} tries on replicas of model '{d.model}' failed before answering", None,
                     "server_error", rid), 502, 0

    async def _hold(self, svc: tuple[str, str], d: ModelDemand, tried: set[str], deadline: float) -> Backend | None:
        """Wait (queued) until a backend not yet tried serves this model, or the deadline."""
        d.queued += 1
        try:
            while True:
                b = pick(self.routes.serving(svc), self.rng, tried)
                if b is not None:
                    return b
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # a change of the table, or an ejection running out, may free a backend; replicas this
                # request already tried get another chance then (a lone replica that was still starting)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.routes.changed().wait(), min(left, 1.0))
                tried.clear()
        finally:
            d.queued -= 1

    async def _forward(self, request: web.Request, body: bytes, b: Backend, stream: bool,
                       rid: str, pre: Backend | None = None) -> tuple[web.StreamResponse, int, int]:
        url = b.url(request.path)
        b.in_flight += 1
        up: aiohttp.ClientResponse | None = None
        send = {"Content-Type": "application/json", REQUEST_ID: rid}  # never a client's header (PREFILL)
        if pre is not None and pre.data:
            send[PREFILL] = pre.data
            pre.in_flight += 1  # a prefill engine is busy with this request until its first token
        try:
            try:
                up = await self.session.post(url, data=body, headers=send, skip_auto_headers=_SKIP)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                b.ejected_until = time.monotonic() + self.s.eject_s
                raise _Retry(f"{b.pod} ({b.address}) unreachable: {type(e).__name__}: {e}") from None
            if up.status == 503:
                text = (await up.read())[:200].decode(errors="replace")
                raise _Retry(f"{b.pod} answered 503: {text}")
            b.reported(up.headers.get(SERVING_SHARE_HEADER))
            headers = {REQUEST_ID: rid, REPLICA: b.pod}
            if pre is not None:
                headers[PREFILLED_BY] = pre.pod
            ctype = up.headers.get("Content-Type", "application/json")
            if not (stream and ctype.startswith(_SSE)):
                try:
                    data = await up.read()
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    raise _Retry(f"{b.pod} failed mid-body: {type(e).__name__}") from None
                return web.Response(status=up.status, body=data, content_type=ctype.split(";")[0],
                                    headers=headers), up.status, _usage_tokens(data)
            try:
                first = await up.content.readany()
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                raise _Retry(f"{b.pod} failed before its first chunk: {type(e).__name__}") from None
            if not first:
                raise _Retry(f"{b.pod} closed the stream before its first chunk")
            if pre is not None:
                pre.in_flight -= 1
                pre = None
            resp = web.StreamResponse(status=up.status, headers={**headers, "Content-Type": ctype,
                                                                 "Cache-Control": "no-cache"})
            await resp.prepare(request)
            n = _events(first)
            await resp.write(first)
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    msg = f"replica {b.pod} failed mid-stream: {type(e).__name__}"
                    log.warning("request %s: %s", rid, msg)
                    err = {"error": {"message": msg, "type": "server_error", "code": 502}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                    return resp, 502, n
                if not chunk:
                    break
                n += _events(chunk)
                await resp.write(chunk)  # the client gone: raises, and `finally` drops the engine connection
            await resp.write_eof()
            return resp, up.status, n
        finally:
            b.in_flight -= 1
            if pre is not None:
                pre.in_flight -= 1
            if up is not None:
                up.close()  # no-op after a complete read; otherwise drops the connection: the engine aborts


def _events(chunk: bytes) -> int:
    """SSE data events in a chunk (one per generated piece; [DONE] not counted)."""
    return chunk.count(b"data: ") - chunk.count(b"data: [DONE]")


def _usage_tokens(data: bytes) -> int:
    if b'"usage"' not in data:
        return 0
    try:
        return int(json.loads(data)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0
