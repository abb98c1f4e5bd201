"""The control API under /kascade/v1/ (bind, load-plan, status, manifest, cooperate, convert, host-copy,
drain, release), used by the operator; every route needs `Authorization: Bearer <token>` (compared in constant time).

Data flow: operator (`EngineClient`) -> bearer check -> JSON body -> the shared wire type
(`kascade_planner.engine_api`: 400 naming the field) -> one `EngineInstance` call -> `EngineStatus`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import Depends, FastAPI, Request

from kascade_engine.instance import EngineInstance
from kascade_engine.refusal import InstanceError
from kascade_planner.engine_api import (
    BindRequest,
    ConvertRequest,
    CooperateRequest,
    HostCopyRequest,
    LoadPlanRequest,
    ReleaseRequest,
    WireError,
)


def add_control_routes(app: FastAPI, inst: EngineInstance) -> None:
    def auth(request: Request) -> None:
        got = request.headers.get("authorization", "")
        if not got.startswith("Bearer "):
            raise InstanceError(401, "missing bearer token (Authorization: Bearer <token>)")
        if not hmac.compare_digest(got[7:].encode(), inst.config.token.encode()):
            raise InstanceError(403, "bearer token rejected")

    guard = [Depends(auth)]

    async def body(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InstanceError(400, f"body is not JSON: {e}") from None

    def parse(f: Any, doc: Any) -> Any:
        try:
            return f(doc)
        except WireError as e:
            raise InstanceError(400, str(e), e.field) from None

    @app.get("/kascade/v1/status", dependencies=guard)
    async def get_status() -> dict[str, Any]:
        return inst.status().to_dict()

    @app.post("/kascade/v1/bind", dependencies=guard)
    async def bind(request: Request) -> dict[str, Any]:
        return (await inst.bind(parse(BindRequest.from_dict, await body(request)))).to_dict()

    @app.get("/kascade/v1/manifest", dependencies=guard)
    async def manifest(parts: int = 1) -> dict[str, Any]:
        """`?parts=g`: also every part entry of the g rank planes of a plan into TP-g targets (tp/planload.py)."""
        if not 1 <= parts <= 64:
            raise InstanceError(400, f"invalid field 'parts': {parts} outside 1..64", "parts")
        held = inst.blockset if inst.blockset is not None and inst.model.complete else inst.host_copy
        tp = inst.config.tp
        if tp > 1 and inst.model.complete and (parts == tp or held is None):
            return await _tp_manifest(parts)
        if held is None:  # (a released engine with a host copy is a host source)
            raise InstanceError(404, "this engine holds no complete copy of the model")
        if parts == 1:
            return dict(held.manifest())
        from kascade_engine.tp.planes import manifest_with_parts

        return await asyncio.to_thread(manifest_with_parts, held, parts)  # hashes the parts: off the loop

    async def _tp_manifest(parts: int) -> dict[str, Any]:
        """A serving TP-g engine: the whole blocks' manifest and, for `parts=g` (a plan into TP-g targets, matched:
        every rank sends its own slices), every rank's slice entries (`<block>@r/g`), asked of the ranks."""
        whole = inst.blockset.manifest() if inst.blockset is not None else inst.tp_whole_manifest
        if whole is None:
            raise InstanceError(404, "this engine holds no manifest of the model's whole blocks")
        if parts == 1:
            return dict(whole)
        if parts != inst.config.tp:
            raise InstanceError(409, f"invalid field 'parts': this tp {inst.config.tp} engine holds only its ranks' "
                                f"slices; it can source TP-{inst.config.tp} targets only", "parts")
        slices = await asyncio.to_thread(inst.ranks.engine.slice_manifests, inst.config.model_name)
        return {**whole, **slices}

    @app.post("/kascade/v1/load-plan", dependencies=guard)
    async def load_plan(request: Request) -> dict[str, Any]:
        return (await inst.load_plan(parse(LoadPlanRequest.from_dict, await body(request)))).to_dict()

    @app.post("/kascade/v1/cooperate", dependencies=guard)
    async def cooperate(request: Request) -> dict[str, Any]:
        return (await inst.set_cooperate(parse(CooperateRequest.from_dict, await body(request)))).to_dict()

    @app.post("/kascade/v1/convert", dependencies=guard)
    async def convert(request: Request) -> dict[str, Any]:
        return inst.convert(parse(ConvertRequest.from_dict, await body(request))).to_dict()

    @app.post("/kascade/v1/host-copy", dependencies=guard)
    async def host_copy(request: Request) -> dict[str, Any]:  # {"keep": bool}: answers hostCopyBytes (+ reason)
        return inst.keep_copy(parse(HostCopyRequest.from_dict, await body(request))).to_dict()

    @app.post("/kascade/v1/drain", dependencies=guard)
    async def drain() -> dict[str, Any]:
        return inst.drain().to_dict()

    @app.post("/kascade/v1/release", dependencies=guard)
    async def release(request: Request) -> dict[str, Any]:  # body optional: {"keepHostCopy": bool}
        return inst.release(parse(ReleaseRequest.from_dict, await body(request)).keep_host_copy).to_dict()
