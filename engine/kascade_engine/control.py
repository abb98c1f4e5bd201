"""The control API under /kascade/v1/ (bind, load-plan, status, manifest, cooperate, drain, release),
used by the operator; every route needs `Authorization: Bearer <token>` (compared in constant time).
`bind` with a `source.path` loads the first copy from disk; `manifest` tells loading targets what a
complete copy here holds (sizes, digests, tensor index); `release` drops the weights.

Data flow: operator (httpx) -> bearer check -> pydantic body (400 naming the field) -> ServerState
fields that the serving path and /metrics read.
"""

from __future__ import annotations

import hmac
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field


class SourceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)


class BindBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    modelService: str
    role: Literal["prefill", "decode", "colocated"]
    source: SourceRef | None = None  # the first copy: load it from this checkpoint directory


class LoadPlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    plan: dict[str, Any]
    self_: str = Field(alias="self")
    peers: dict[str, str]
    planToken: str = Field(min_length=1)
    manifest: dict[str, Any] | None = None  # targets need it (sizes, digests, index); sources use their own
    chunkBytes: int = 1 << 20
    timeoutSeconds: float = 10.0


class CooperateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    peer: str
    mode: Literal["zigzag", "besteffort", "off"]


def add_control_routes(app: FastAPI, st: Any, ApiError: Any) -> None:
    def auth(request: Request) -> None:
        got = request.headers.get("authorization", "")
        if not got.startswith("Bearer "):
            raise ApiError(401, "missing bearer token (Authorization: Bearer <token>)", None, "authentication_error")
        if not hmac.compare_digest(got[7:].encode(), st.token.encode()):
            raise ApiError(403, "bearer token rejected", None, "authentication_error")

    guard = [Depends(auth)]

    def status() -> dict[str, Any]:
        m = st.engine.model
        ids = ["embed", *(f"layer.{i}" for i in range(m.shape.layers)), "head"]
        return {"instance": st.instance, "model": st.model_name, "role": st.role, "modelService": st.model_service,
                "phase": st.phase, "blocks": {b: m.resident(b) for b in ids}, "bytesReceived": st.bytes_received,
                "ready": st.phase == "ready" and m.complete, "cooperate": st.cooperate or None,
                "loadError": st.load_error}

    @app.get("/kascade/v1/status", dependencies=guard)
    async def get_status() -> dict[str, Any]:
        return status()

    @app.post("/kascade/v1/bind", dependencies=guard)
    async def bind(body: BindBody) -> dict[str, Any]:
        if body.model != st.model_name:
            raise ApiError(409, f"cannot bind model '{body.model}': this engine holds '{st.model_name}'", "model")
        if st.model_service not in (None, body.modelService):
            raise ApiError(409, f"engine is bound to '{st.model_service}'; release it first", "modelService")
        st.model_service, st.role = body.modelService, body.role
        if st.phase == "idle":
            st.phase = "ready" if st.engine.model.complete else "loading"
        if body.source is not None and not st.engine.model.complete and (st.loading is None or st.loading.done()):
            from kascade_engine.loader import PlanLoadError, start_source_load

            try:
                await start_source_load(st, body.source.path)
            except PlanLoadError as e:
                raise ApiError(e.status, str(e), e.field) from None
        return status()

    @app.get("/kascade/v1/manifest", dependencies=guard)
    async def manifest() -> dict[str, Any]:
        if st.blockset is None or not st.engine.model.complete:
            raise ApiError(404, "this engine holds no complete copy of the model", None)
        return dict(st.blockset.manifest())

    @app.post("/kascade/v1/load-plan", dependencies=guard)
    async def load_plan(body: LoadPlanBody) -> dict[str, Any]:
        from kascade_engine.loader import PlanLoadError, start_loading

        try:
            await start_loading(st, body.model_dump(by_alias=True))
        except PlanLoadError as e:
            raise ApiError(e.status, str(e), e.field) from None
        return status()

    @app.post("/kascade/v1/cooperate", dependencies=guard)
    async def cooperate(body: CooperateBody) -> dict[str, Any]:
        st.cooperate = {} if body.mode == "off" else {"peer": body.peer, "mode": body.mode}
        return status()

    @app.post("/kascade/v1/drain", dependencies=guard)
    async def drain() -> dict[str, Any]:
        st.phase = "draining"  # new requests get 503; in-flight ones finish
        return status()

    @app.post("/kascade/v1/release", dependencies=guard)
    async def release() -> dict[str, Any]:
        if not st.engine.scheduler.idle:
            raise ApiError(409, "requests still in flight; drain first and wait", None)
        from kascade_engine.loader import drop_weights

        if st.loading is not None and not st.loading.done():
            st.loading.cancel()
        st.phase, st.model_service, st.role, st.cooperate = "idle", None, "colocated", {}
        drop_weights(st)
        return status()
