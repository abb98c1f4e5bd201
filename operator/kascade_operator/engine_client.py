"""Client of the engine control API (`/kascade/v1/...`, bearer token) used by the operator.

Data flow: scaleplan/pool logic -> `EngineClient.<verb>(endpoint, ...)` -> the request type shared
with the engine (`kascade_planner.engine_api`, one definition for both ends) -> httpx POST/GET with a
timeout (HTTPS verified by the installation's CA when engines serve TLS) -> JSON status dict, or
`EngineError` naming the endpoint, the call and the engine's message.
Keep-alive clients per engine (httppool.py) keep instruct latency low at any number of engines.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
from typing import Any, Literal, cast

import httpx

from kascade_operator.httppool import HttpPool
from kascade_planner.engine_api import (
    BindRequest,
    ConvertRequest,
    CooperateRequest,
    HostCopyAnswer,
    HostCopyRequest,
    LoadPlanRequest,
    Mode,
    ReleaseRequest,
    Role,
    WireError,
    ZigZagSpec,
)

log = logging.getLogger(__name__)

PREFIX = "/kascade/v1/"


class EngineError(RuntimeError):
    """An engine control call failed; `status` is the HTTP status (None for network errors/timeouts)."""

    def __init__(self, endpoint: str, call: str, message: str, status: int | None = None) -> None:
        super().__init__(f"engine {endpoint} {call}: {message}")
        self.endpoint, self.call, self.status = endpoint, call, status


def _message(r: httpx.Response) -> str:
    """The engine's error message ({"error": {"message"}} or FastAPI's {"detail"}), else the raw text."""
    try:
        doc = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if doc.get("detail"):
            return str(doc["detail"])
    return r.text[:500]


class EngineClient:
    def __init__(self, token: str, timeout_s: float = 2.0, client: httpx.AsyncClient | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the engines serve HTTPS (engine_tls_context of the installation's CA); None: plain HTTP."""
        if not token:
            raise ValueError("engine token must not be empty")
        self._token = token
        self._http = HttpPool(timeout_s, client, tls)

    async def aclose(self) -> None:
        await self._http.aclose()

    def plan_secret(self, namespace: str, plan: str, uid: str) -> str:
        """The secret the participants of one ScalePlan authenticate each other with on the data plane.

        A keyed hash (HMAC-SHA256) of the plan's identity under this installation's engine token: as
        unpredictable as a random value to anyone without that token (reading the ScalePlan gives only
        its name and uid, which are the message, not the key), different for every plan, never stored
        (not in the CR, not in a Secret) and the same after an operator restart, so targets instructed
        before and after a restart still agree. It reaches the engines only in `load-plan` bodies,
        over the bearer-authenticated control API."""
        msg = f"kascade-plan/v1\0{namespace}\0{plan}\0{uid}".encode()
        return hmac.new(self._token.encode(), msg, hashlib.sha256).hexdigest()

    async def _call(self, endpoint: str, method: Literal["GET", "POST"], verb: str,
                    body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = self._http.url(endpoint, PREFIX + verb)
        try:
            r = await self._http.get(endpoint).request(method, url, json=body,
                                           headers={"Authorization": f"Bearer {self._token}"})
        except httpx.TimeoutException:
            raise EngineError(endpoint, verb, "timed out") from None
        except httpx.HTTPError as e:
            raise EngineError(endpoint, verb, f"{type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise EngineError(endpoint, verb, f"HTTP {r.status_code}: {_message(r)}", r.status_code)
        try:
            out = r.json()
        except ValueError:
            raise EngineError(endpoint, verb, f"response is not JSON: {r.text[:200]!r}", r.status_code) from None
        if not isinstance(out, dict):
            raise EngineError(endpoint, verb, "response is not a JSON object", r.status_code)
        return out

    async def status(self, endpoint: str) -> dict[str, Any]:
        return await self._call(endpoint, "GET", "status")

    async def bind(self, endpoint: str, model: str, model_service: str, role: str,
                   source_path: str | None = None, dtype: str | None = None,
                   host_copy: bool = False, model_path: str | None = None, node_copy: bool = False
                   ) -> dict[str, Any]:
        """Bind the engine to a service; with `source_path` it also loads the first copy from that directory
        (an `hf://` URI, what a ScalePlan's host source carries for a Hub source, goes as `source.uri`);
        with `host_copy` from the host copy the engine kept at its last release. `model_path`: the model's
        checkpoint directory, for an engine started for another model (it switches, holding no weights).
        `node_copy`: from the copy its node's cache holds (a ScalePlan target marked nodeCopy)."""
        if node_copy:
            req = BindRequest(model, model_service, cast(Role, role), None, dtype, None, False, model_path, True)
            return await self._call(endpoint, "POST", "bind", req.to_dict())
        if host_copy:
            req = BindRequest(model, model_service, cast(Role, role), None, dtype, None, True, model_path)
            return await self._call(endpoint, "POST", "bind", req.to_dict())
        uri = source_path if source_path and source_path.startswith("hf://") else None
        req = BindRequest(model, model_service, cast(Role, role), None if uri else (source_path or None), dtype, uri,
                          False, model_path)
        return await self._call(endpoint, "POST", "bind", req.to_dict())

    async def load_plan(self, endpoint: str, plan: dict[str, Any], self_id: str, peers: dict[str, str],
                        plan_token: str, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        req = LoadPlanRequest(plan, self_id, peers, plan_token, manifest)
        return await self._call(endpoint, "POST", "load-plan", req.to_dict())

    async def cooperate(self, endpoint: str, peer: str, mode: Mode, zigzag: ZigZagSpec | None = None) -> dict[str, Any]:
        """Live execution (livewiring.py): pair with `peer`'s activation port (zigzag / besteffort), warm
        that connection ahead (standby), be a pipeline hop towards it (pipeline), or stop (off)."""
        return await self._call(endpoint, "POST", "cooperate", CooperateRequest(peer, mode, zigzag).to_dict())

    async def convert(self, endpoint: str, prefill_chunk_tokens: int | None,
                      step_budget_s: float | None = None, hand_back_s: float | None = None) -> dict[str, Any]:
        """Convertible decoder (TokenScale): take prefill with at most this many prompt tokens per step, and
        in a step that decodes only what the engine predicts within `step_budget_s`; hand a prompt it prefills
        itself to a prefill engine when it lags for `hand_back_s`; None takes it back."""
        ms = None if step_budget_s is None else step_budget_s * 1e3
        hb = None if hand_back_s is None else hand_back_s * 1e3
        return await self._call(endpoint, "POST", "convert",
                                ConvertRequest(prefill_chunk_tokens, ms, hb).to_dict())

    async def drain(self, endpoint: str) -> dict[str, Any]:
        return await self._call(endpoint, "POST", "drain")

    async def release(self, endpoint: str, keep_host_copy: bool | None = None) -> dict[str, Any]:
        """Unbind; `keep_host_copy` False drops the weights everywhere (None: the engine keeps a host copy when
        its budget holds it)."""
        return await self._call(endpoint, "POST", "release", ReleaseRequest(keep_host_copy).to_dict())

    async def host_copy(self, endpoint: str, keep: bool = True) -> HostCopyAnswer:
        """A serving engine keeps (or drops) its copy as a host copy within its --host-cache-gib budget; the
        answer says how many bytes it keeps, or why none."""
        out = await self._call(endpoint, "POST", "host-copy", HostCopyRequest(keep).to_dict())
        try:
            return HostCopyAnswer.from_dict(out)
        except WireError as e:
            raise EngineError(endpoint, "host-copy", f"bad answer: {e}", 502) from None

    async def manifest(self, endpoint: str, parts: int = 1) -> dict[str, Any] | None:
        """The block manifest (sizes, digests, index) a source holds, for loading targets; None when the
        engine does not offer `GET manifest` (then targets must already know it). `parts` g > 1: with the part
        entries of every rank plane into TP-g targets (their digests: the source hashes its blocks' parts)."""
        try:
            return await self._call(endpoint, "GET", "manifest" if parts == 1 else f"manifest?parts={parts}")
        except EngineError as e:
            if e.status in (404, 405):
                return None
            raise
