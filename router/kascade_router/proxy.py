"""The hot path: one OpenAI request in, one engine's answer out (streamed through as it arrives).

Data flow: API key (optional, `auth.ApiKeys`: 401/403) -> the whole body (`read_body`: <= max_body_bytes, else
413; within body_timeout_s, else 408) -> JSON object with a string `model` (else 400 naming
it) -> `Routes.lookup` (unknown model: 404 naming it) -> `balancer.pick_pd` among serving backends by the
`route` setting (expected TTFT or share), or held until one appears (bounded queue: 429; timeout: 503, both
with Retry-After) -> POST to the engine
with the request id (disaggregated: the prefill engine's data port from `pick_pd`, or for a converted decoder
that prefills the prompt itself a prefill engine to hand it to if it finds no room, `fallback_prefill`)
-> the answer is streamed through as it arrives (`_relay_whole` for a non-streamed one, never held whole; a
stream chunk by chunk). No byte from the engine for first_byte_s: `health.Health` probes it, a hung one is
ejected and the request moves on (`_first_byte`). A replica that fails before any byte reached the client (refused
connection, 503 from a draining engine, closed before its first chunk) is excluded and another is
tried; a failure mid-stream ends that response with an SSE error event. A client that goes away
cancels the handler, which closes the engine connection, which aborts the generation there. Engine
connections are `upstream.Upstreams` (pooled keep-alive; streamed chunks are relayed in the socket
callback, not by this handler).

First tokens: each request is one `firsttoken.Waiting` on the engine that prefills it (the prefill engine in
disaggregated serving, else the engine it went to; moved to the prefill engine a converted decoder hands it
to, or to the decoder that prefills a prompt a converted decoder declined for it), ended by its first token (a stream's
first data event after its chat role events, seen in the socket
callback: `Answer.on_token`), for a non-streamed answer by the answer itself (the whole answer: its TTFT is
an upper bound), else by its end without one. They live on the `Backend` (`Backend.first_tokens`), so a
model's `Routes` entry owns them and they go with the backend when its pod leaves. The prefill engine's
prompt count (`in_flight`, `prefilling`) drops at the same first token.
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
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kascade_planner.engine_api import (
    HANDED_BACK_HEADER,
    PREFILL_FALLBACK_HEADER,
    PREFILL_HEADER,
    PREFILL_RATE_HEADER,
    PREFILL_ROOM_HEADER,
    PREFILL_SIG_HEADER,
    SERVING_SHARE_HEADER,
    HandedBack,
    WireError,
    prefill_signature,
)
from kascade_router.auth import ApiKeys, Key
from kascade_router.backends import Backend, Routes
from kascade_router.balancer import fallback_prefill, pick, pick_pd
from kascade_router.demand import Demand, ModelDemand
from kascade_router.firsttoken import Waiting
from kascade_router.health import Health
from kascade_router.settings import RouterSettings
from kascade_router.upstream import Answer, UpstreamError, Upstreams

log = logging.getLogger(__name__)
T = TypeVar("T")
REQUEST_ID = "X-Request-Id"
_STARTED = "kascade.answer-started"  # request-storage key: the client's answer's headers went out
REPLICA = "X-Kascade-Replica"  # which pod answered (clients, tests and logs can tell)
PREFILL = PREFILL_HEADER  # to a decode engine: host:port of the prefill engine's data port (PD)
PREFILLED_BY = "X-Kascade-Prefilled-By"  # to the client: which prefill pod the router chose
_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SSE = "text/event-stream"
SERVING_SHARE_HEADER_LC = SERVING_SHARE_HEADER.lower()  # upstream header names are kept lower-case
PREFILL_ROOM_HEADER_LC = PREFILL_ROOM_HEADER.lower()
PREFILL_RATE_HEADER_LC = PREFILL_RATE_HEADER.lower()
HANDED_BACK_HEADER_LC = HANDED_BACK_HEADER.lower()


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          rid: str = "", retry_after: int | None = None) -> web.Response:
    headers = {REQUEST_ID: rid} if rid else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


async def read_body(request: web.Request, limit: int, timeout_s: float, rid: str) -> bytes | web.Response:
    """The whole request body, however it arrives (several TCP reads, chunked, after a 100-continue), or the
    error answer: 413 past `limit` bytes, 408 if not complete within `timeout_s`, 400 if the client broke it
    off. (`content.read(n)` returns what is buffered, not n bytes: a body in two flights read as half a JSON.)"""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                piece = await request.content.readany()
                if not piece:
                    break
                size += len(piece)
                if size > limit:
                    return _closing(error(413, f"request body exceeds the limit of {limit} bytes", None, rid=rid))
                parts.append(piece)
    except TimeoutError:
        return _closing(error(408, f"request body not complete within {timeout_s:g} s ({size} bytes arrived)",
                              None, rid=rid))
    except (aiohttp.ClientError, ConnectionError, aiohttp.web.HTTPException) as e:
        return error(400, f"could not read the request body: {e}", None, rid=rid)
    return b"".join(parts)


def _closing(resp: web.Response) -> web.Response:
    """The rest of the body is not read: the connection cannot carry another request."""
    resp.force_close()
    return resp


class _Retry(Exception):
    """This replica failed before any byte reached the client: try another (`unavailable`: it answered 503)."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


def role_events(path: str, doc: dict[str, Any]) -> int:
    """SSE data events a streamed answer sends before any token: a chat completion's role event per choice
    (`n`, default 1; the engine sends them as the stream starts, before the prompt is prefilled), none for a
    completion. A bad `n` counts 1: the engine refuses it anyway."""
    if not path.endswith("/chat/completions"):
        return 0
    n = doc.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 else 1


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
    def __init__(self, routes: Routes, demand: Demand, settings: RouterSettings, upstreams: Upstreams,
                 seed: int | None = None, health: Health | None = None, keys: ApiKeys | None = None) -> None:
        self.routes, self.demand, self.s, self.upstreams = routes, demand, settings, upstreams
        self.keys = keys  # None: no client authentication
        self.rng = random.Random(seed)
        self.health = health or Health(routes, settings.eject_s, settings.eject_after_failures,
                                       settings.probe_timeout_s, upstreams.tls)

    def _serving(self, svc: tuple[str, str]) -> list[Backend]:
        """Serving backends with a free connection slot (`max_backend_connections`)."""
        cap = self.s.max_backend_connections
        return [b for b in self.routes.serving(svc) if b.in_flight < cap]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(REQUEST_ID, "")
        if not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        key: Key | None = None
        if self.keys is not None:
            key = self.keys.lookup(request.headers.get("Authorization"))
            if key is None:
                denied = error(401, "a valid API key is required (Authorization: Bearer KEY)", None,
                               "authentication_error", rid=rid)
                denied.headers["WWW-Authenticate"] = "Bearer"
                return _closing(denied)  # its body is not read
        if request.content_length is not None and request.content_length > self.s.max_body_bytes:
            return error(413, f"request body is {request.content_length} bytes, the limit is "
                              f"{self.s.max_body_bytes}", None, rid=rid)
        body_or_error = await read_body(request, self.s.max_body_bytes, self.s.body_timeout_s, rid)
        if isinstance(body_or_error, web.Response):
            return body_or_error
        body = body_or_error
        try:
            doc = json.loads(body)
        except ValueError as e:
            return error(400, f"malformed JSON body: {e}", None, rid=rid)
        except RecursionError:  # the C decoder recurses per nesting level
            return error(400, "the JSON body is nested too deeply", None, rid=rid)
        if not isinstance(doc, dict):
            return error(400, "the request body must be a JSON object", None, rid=rid)
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return error(400, "field 'model' is required and must be a non-empty string", "model", rid=rid)
        if key is not None and not key.allows(model):
            return error(403, f"this API key may not use model '{model}'", "model", "permission_error", rid=rid)
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
            resp, status, out_tokens = await self._route(request, body, svc, d, stream, rid, now,
                                                         role_events(request.path, doc))
            return resp
        except asyncio.CancelledError:
            status = 499  # the client went away (handler cancellation)
            raise
        except ConnectionError:
            status = 499  # the client went away while we wrote to it
            return web.Response(status=499)
        except Exception as e:  # a bug: answered in OpenAI's shape, naming it (aiohttp's HTML page read as a bare
            # "Error code: 500" in every OpenAI client), unless the answer is under way (then the connection is cut)
            if request.get(_STARTED):
                raise
            log.exception("request %s: the router failed", rid)
            return error(500, f"router failed on this request: {type(e).__name__}: {e}", None, "server_error", rid)
        finally:
            d.in_flight -= 1
            d.finished(status, prompt_tokens(doc), out_tokens, time.monotonic())

    async def _route(self, request: web.Request, body: bytes, svc: tuple[str, str], d: ModelDemand, stream: bool,
                     rid: str, t0: float, skip: int = 0) -> tuple[web.StreamResponse, int, int]:
        tried: set[str] = set()
        deadline = t0 + self.s.hold_timeout_s
        held, tries, unavailable = False, 0, 0  # unavailable: tries answered 503 (draining, loading, full)
        while tries < self.s.attempts:
            b, pre = pick_pd(self._serving(svc), self.rng, tried, self.s.route)
            if b is None:
                if not held and d.queued >= self.s.max_queued:
                    return error(429, f"{d.queued} requests for model '{d.model}' are already waiting for a "
                                      f"serving replica (limit {self.s.max_queued})", None, "rate_limit_exceeded",
                                 rid, self.s.retry_after_s), 429, 0
                b = await self._hold(svc, d, tried, deadline)
                held = True
                if b is not None:
                    b, pre = pick_pd(self._serving(svc), self.rng, tried, self.s.route)
                if b is None:
                    return error(503, self._why_none(svc, d, tries, unavailable), None, "unavailable", rid,
                                 self.s.retry_after_s), 503, 0
            tried.add(b.pod)
            tries += 1
            fallback = fallback_prefill(self.routes.serving(svc), b, pre)
            try:
                return await self._forward(request, body, b, stream, rid, pre, fallback, d, skip)
            except _Retry as e:
                unavailable += e.unavailable
                log.info("request %s: %s; retrying on another replica", rid, e)
        if unavailable == tries:  # every replica said it cannot serve now: that is what the client hears
            return error(503, f"{tries} tries on replicas of model '{d.model}' all answered 503 (unavailable)",
                         None, "unavailable", rid, self.s.retry_after_s), 503, 0
        return error(502, f"{tries} tries on replicas of model '{d.model}' failed before answering", None,
                     "server_error", rid), 502, 0

    def _why_none(self, svc: tuple[str, str], d: ModelDemand, tries: int, unavailable: int) -> str:
        if tries:
            return (f"replicas of model '{d.model}' failed before answering ({tries} tries, {unavailable} answered "
                    "503)")
        if self.routes.serving(svc):
            return (f"every replica of model '{d.model}' is at this router's connection limit "
                    f"({self.s.max_backend_connections}) for {self.s.hold_timeout_s:g} s")
        return (f"no serving replica of model '{d.model}' (ModelService {svc[0]}/{svc[1]}) within "
                f"{self.s.hold_timeout_s:g} s; it may be scaling from zero")

    async def _hold(self, svc: tuple[str, str], d: ModelDemand, tried: set[str], deadline: float) -> Backend | None:
        """Wait (queued) until a backend not yet tried serves this model, or the deadline."""
        d.queued += 1
        try:
            while True:
                b = pick(self._serving(svc), self.rng, tried)
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

    async def _forward(self, request: web.Request, body: bytes, b: Backend, stream: bool, rid: str,
                       pre: Backend | None = None, fallback: Backend | None = None,
                       d: ModelDemand | None = None, skip: int = 0) -> tuple[web.StreamResponse, int, int]:
        """Send the request to `b` (prefilled by `pre` if given) and answer the client; `skip`: data events
        before the first token (`role_events`)."""
        b.in_flight += 1
        prefills = pre if pre is not None and pre.data else b  # who prefills this request
        prefills.prefilling += 1
        prefiller: Backend | None = prefills  # ... until its first token (None after it)
        wait = Waiting(prefills.first_tokens, time.monotonic())  # its first token, timed at who prefills it
        up: Answer | None = None
        send = {"Content-Type": "application/json", REQUEST_ID: rid}  # never a client's header (PREFILL)
        if pre is not None and pre.data:
            send[PREFILL] = pre.data
            pre.in_flight += 1  # a prefill engine is busy with this request until its first token
        if fallback is not None and fallback.data:  # a converted decoder prefills it: where to hand it back
            # (`pre` one: b names it in its prefill op); b answers once who prefills it is settled (HANDED_BACK_HEADER)
            send[PREFILL_FALLBACK_HEADER] = fallback.data
        if self.s.engine_token and (PREFILL in send or PREFILL_FALLBACK_HEADER in send):
            send[PREFILL_SIG_HEADER] = prefill_signature(self.s.engine_token, send.get(PREFILL),
                                                         send.get(PREFILL_FALLBACK_HEADER))
        timeout = self.s.read_timeout_s
        try:
            try:
                up = await self._first_byte(b, self.upstreams.request(b.address, request.path, body, send, timeout))
            except UpstreamError as e:
                self.health.failed(b, e.refused, str(e))
                raise _Retry(f"{b.pod} ({b.address}): {e}") from None
            self.health.succeeded(b)
            if up.status == 503:
                with contextlib.suppress(UpstreamError):
                    text = (await up.read(timeout))[:200].decode(errors="replace")
                    raise _Retry(f"{b.pod} answered 503: {text}", unavailable=True)
                raise _Retry(f"{b.pod} answered 503", unavailable=True)
            b.reported(up.headers.get(SERVING_SHARE_HEADER_LC))
            b.reported_room(up.headers.get(PREFILL_ROOM_HEADER_LC))
            b.reported_rate(up.headers.get(PREFILL_RATE_HEADER_LC))
            to = _handed_to(up.headers.get(HANDED_BACK_HEADER_LC), b, fallback, rid)
            moved = to is not None and to is not prefills
            if moved and to is not None:
                # the prompt is prefilled elsewhere than we said: a converted decoder (b itself, or `pre` for b)
                # gave it to the prefill engine we named as fallback, or b prefills it itself. From now until its
                # first token that engine prefills it (its load, its first token), and the client is told so
                prefills.prefilling -= 1
                if pre is not None:
                    pre.in_flight -= 1
                pre = to if to is not b else None  # b's own in_flight already counts the request
                if pre is not None:
                    pre.in_flight += 1
                prefills = prefiller = to
                to.prefilling += 1
                now = time.monotonic()  # its wait for a first token continues there
                wait.gone(now)
                # a non-streamed answer starts at its end: its first token is long past, it times nothing there
                wait = Waiting(to.first_tokens, now)
                if d is not None:
                    d.handbacks += 1
            headers = {REQUEST_ID: rid, REPLICA: b.pod}
            if pre is not None:
                headers[PREFILLED_BY] = pre.pod
            ctype = up.headers.get("content-type", "application/json")
            if not (stream and ctype.startswith(_SSE)):
                return await self._relay_whole(request, up, headers, ctype, wait if not moved else None, b, rid,
                                               timeout)
            try:
                if not await self._first_byte(b, up.first_data(timeout)):
                    raise _Retry(f"{b.pod} closed the stream before its first chunk")
            except UpstreamError as e:
                raise _Retry(f"{b.pod} failed before its first chunk: {e}") from None

            def first_token() -> None:  # in the engine socket's callback, at the first token's event
                nonlocal pre, prefiller
                wait.first(time.monotonic())
                if pre is not None:  # the prefill engine is done with it
                    pre.in_flight -= 1
                    pre = None
                if prefiller is not None:
                    prefiller.prefilling -= 1
                    prefiller = None

            up.on_token(skip, first_token)
            resp = web.StreamResponse(status=up.status, headers={**headers, "Content-Type": ctype,
                                                                 "Cache-Control": "no-cache"})
            framed = request.version >= aiohttp.HttpVersion11
            if framed:
                resp.enable_chunked_encoding()
            await resp.prepare(request)  # a StreamResponse sends its headers now: raw bytes may follow
            request[_STARTED] = True
            client = request.transport
            if client is None or client.is_closing():
                raise ConnectionError("the client went away")
            # an HTTP/1.1 client gets the engine's own chunks byte for byte (its response is chunked too);
            # an HTTP/1.0 one the payload, delimited by close
            up.relay(client, framed)
            try:
                await up.finished(timeout)
            except UpstreamError as e:
                if client.is_closing():
                    raise ConnectionError("the client went away") from None
                msg = f"replica {b.pod} failed mid-stream: {e}"
                log.warning("request %s: %s", rid, msg)
                if not up.at_boundary:  # inside a chunk: the client's framing cannot be resumed
                    client.close()
                    return resp, 502, up.events
                err = {"error": {"message": msg, "type": "server_error", "code": 502}}
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                return resp, 502, up.events
            await resp.write_eof()
            return resp, up.status, up.events
        finally:
            wait.gone(time.monotonic())  # ended without a first token (nothing if it had one)
            if up is not None:
                up.on_token(0, None)  # never called after this: the counts below are final
            b.in_flight -= 1
            if b.in_flight == self.s.max_backend_connections - 1:
                self.routes.wake()  # a connection slot freed: a request waiting for one may go
            if pre is not None:
                pre.in_flight -= 1
            if prefiller is not None:
                prefiller.prefilling -= 1
            if up is not None:
                self.upstreams.release(up)  # pooled after a clean end; otherwise closed: the engine aborts

    async def _first_byte(self, b: Backend, aw: Awaitable[T]) -> T:
        """`aw` (an engine's answer head, or a stream's first data), probing the engine's /readyz after every
        `first_byte_s` of waiting: an engine that answers neither is hung: ejected, and the request (nothing of
        which reached the client) goes elsewhere. A busy engine answers its probe, and the request waits on."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.s.first_byte_s)
                if done:
                    return task.result()
                if not await self.health.alive(b):
                    why = (f"nothing for {self.s.first_byte_s:g} s and no answer to a /readyz probe within "
                           f"{self.s.probe_timeout_s:g} s")
                    self.health.hung(b, why)
                    raise _Retry(f"{b.pod} ({b.address}) is hung: {why}")
        finally:
            if not task.done():
                task.cancel()  # closes the engine connection (Upstreams.request), which aborts it there
                with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                    await task

    async def _relay_whole(self, request: web.Request, up: Answer, headers: dict[str, str], ctype: str,
                           wait: Waiting | None, b: Backend, rid: str, timeout: float
                           ) -> tuple[web.StreamResponse, int, int]:
        """A non-streamed answer (or an error answer), streamed through as it arrives, never held whole (a 200 MB
        answer took 682 MB of router memory); its usage is read from its last bytes. `wait`: timed at its end."""
        resp = web.StreamResponse(status=up.status, headers={**headers, "Content-Type": ctype})
        length = up.headers.get("content-length")
        framed = request.version >= aiohttp.HttpVersion11
        if length is not None and length.isdigit() and "chunked" not in up.headers.get("transfer-encoding", ""):
            resp.content_length = int(length)
            framed = False  # the payload as is, delimited by its length
        elif framed:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        request[_STARTED] = True
        client = request.transport
        if client is None or client.is_closing():
            raise ConnectionError("the client went away")
        up.keep_tail = True
        up.relay(client, framed)
        try:
            await up.finished(timeout)
        except UpstreamError as e:
            if client.is_closing():
                raise ConnectionError("the client went away") from None
            log.warning("request %s: replica %s failed mid-answer: %s", rid, b.pod, e)
            client.close()  # a JSON answer cut short cannot be completed or marked: the client sees it cut
            return resp, 502, 0
        await resp.write_eof()
        if up.status == 200 and wait is not None:  # an error answer is no first token: a failing engine must not
            # look fast; nor one a hand-back moved the request to as its answer ended (a TTFT of ~0)
            wait.first(time.monotonic())
        return resp, up.status, _usage_tokens(up.tail)


def _handed_to(value: str | None, b: Backend, fallback: Backend | None, rid: str) -> Backend | None:
    """Who prefills the prompt by `b`'s HANDED_BACK_HEADER (`value`): the fallback prefill engine we named, `b`
    itself (HANDED_BACK_HERE), or None (no header; a bad one, or an engine we did not name, logged)."""
    if value is None:
        return None
    try:
        to = HandedBack.parse(value).to
    except WireError as e:
        log.warning("request %s: %s answered %s", rid, b.pod, e)
        return None
    if to is None:
        return b
    if fallback is not None and to == fallback.data:
        return fallback
    log.warning("request %s: %s says it handed the prompt to %r, not the prefill engine named (%s)",
                rid, b.pod, to, fallback.data if fallback else None)
    return None


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def _usage_tokens(tail: bytes) -> int:
    """completion_tokens from an answer's last bytes (its usage object ends it)."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else 0
