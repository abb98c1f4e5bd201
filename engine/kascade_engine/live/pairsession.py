"""Pair sessions: how a pair's one connection is opened (B, at cooperate time: `form_pair` on a connection
the PeerPool warmed ahead, then `open_pair`) and served (A: `host_pair`, one loop per session on the
activation port). The frames are described in cooperation.py (steps) and redirect.py (redirection).

Data flow on A: each step frame -> validated `PairStep` -> `HostRows.submit` + wake A's loop -> A's next
step runs the rows -> the tokens (and redirect fields) go back on the same connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from kascade_engine.batch import timeline
from kascade_engine.batch.model import LlamaModel
from kascade_engine.live.activation import DTYPES, decode_activation
from kascade_engine.live.cooperation import HostRows, PairStep
from kascade_engine.live.pairclient import PIPELINE_DEPTH_PER_RECEIVER, PairClient
from kascade_engine.net.transport import Connection, TransportError

log = logging.getLogger(__name__)


async def open_pair(model: LlamaModel, conn: Connection, token: str | None) -> PairClient:
    """Authenticate and form the pair on an open connection (at cooperate time, not per request)."""
    if token is not None:
        from kascade_engine.net.peerauth import join

        await join(conn, token, "activation", timeout=10)
    s = model.shape
    await conn.send({"op": "pair", "layers": s.layers, "hidden": s.hidden})
    reply, _ = await conn.recv(timeout=10)
    if reply.get("op") != "paired":
        raise RuntimeError(f"peer refused the pair: {reply.get('message', reply)}")
    pc = PairClient(model, conn, asyncio.get_running_loop())
    pc.peer_complete = reply.get("complete") is not False  # an older peer says nothing: a source, as before
    first = reply.get("first")
    pc.peer_first = first if isinstance(first, int) and 0 <= first <= s.layers else None
    n = reply.get("receivers")
    pc.peer_receivers = n if isinstance(n, int) and n >= 0 and not pc.peer_complete else 0 if pc.peer_complete else 1
    return pc


async def form_pair(inst: Any, peer: str) -> PairClient:
    """B forms its pair with the engine whose activation port is `peer` ("host:port"), on a connection
    the instance's PeerPool warmed ahead when there is one (no handshake now), else a fresh one."""
    conn, warmed = await inst.peers.take(peer)
    try:
        pair = await open_pair(inst.model, conn, None)
    except (OSError, RuntimeError, TransportError):
        await conn.close()
        if not warmed:
            raise
        conn, _ = await inst.peers.take(peer)  # the warmed one went stale: one fresh try
        try:
            pair = await open_pair(inst.model, conn, None)
        except BaseException:
            await conn.close()
            raise
    pair.fallback, pair.layer_s, pair.knee_tokens = inst.host, inst.host.layer_s, inst.host.knee_tokens
    pair.emit = inst.serving.publish  # tokens that land while a step of ours runs go out at once
    if not pair.peer_complete:  # the head of a pipeline: its stage (PairClient.stage)
        prefix, first = inst.model.resident_prefix(), pair.peer_first
        pair.stage = prefix if first is None else min(prefix, first)
        pair.depth = PIPELINE_DEPTH_PER_RECEIVER * max(1, pair.peer_receivers)
    log.info("%s: paired with %s (%s connection, used by every step)", inst.instance_id, peer,
             "warmed" if warmed else "new")
    return pair


async def host_pair(host: HostRows, model: LlamaModel, conn: Connection, first: dict[str, Any], pair: int,
                    wake: Callable[[], None], max_payload: int) -> None:
    """A's side of one pair session: every B step joins A's next batch; tokens go back."""
    s = model.shape
    if first.get("layers") != s.layers or first.get("hidden") != s.hidden:
        await conn.send({"op": "error", "message": f"pair shape {first.get('layers')}x{first.get('hidden')} "
                                                  f"!= this model's {s.layers}x{s.hidden}"})
        return
    # complete: whether this engine holds the whole model (a serving source) or is itself a receiver of a
    # pipeline (its rows go on to the next one): the pair's router weight differs (instance.serving_share)
    # receivers: the loading engines that run a row from here on (this one and its pipeline downstream; 0 on a
    # source): a pipeline head weighs them all (instance.serving_share)
    down = host.downstream
    receivers = 0 if model.complete else 1 + (down.peer_receivers if down is not None else 0)
    # first: the lowest layer held here (a pipeline head leaves the layers from there to this receiver)
    lowest = next((i for i in range(s.layers) if model.resident(f"layer.{i}")), s.layers)
    await conn.send({"op": "paired", "pair": pair, "complete": model.complete, "receivers": receivers,
                     "first": lowest})
    loop = asyncio.get_running_loop()
    # B keeps several steps out (pairclient.PIPELINE_DEPTH): read the next frame while A still runs
    # the last one; answers go back in frame order from one writer.
    answers: asyncio.Queue[tuple[asyncio.Future[list[int] | Exception] | None, PairStep | None, str]] = \
        asyncio.Queue()
    writer = asyncio.create_task(_answer(conn, answers))
    try:
        while not writer.done():
            try:
                header, payload = await conn.recv(max_payload=max_payload)
            except TransportError:
                return
            if header.get("op") != "step":
                await answers.put((None, None, f"unknown op {header.get('op')!r} in a pair session"))
                continue
            try:
                rows, ends = header.get("rows"), header.get("end") or []
                if not isinstance(rows, list) or not isinstance(ends, list):
                    raise ValueError("a pair step needs lists 'rows' and 'end'")
                if header.get("dtype") not in DTYPES:
                    raise ValueError(f"activation dtype {header.get('dtype')!r} not supported")
                hidden = (decode_activation(header, payload, s.hidden) if rows
                          else torch.empty(0, s.hidden, dtype=model.dtype, device=model.device))
            except ValueError as e:
                await answers.put((None, None, str(e)))
                continue
            fut: asyncio.Future[list[int] | Exception] = loop.create_future()

            def done(v: list[int] | Exception, fut: asyncio.Future[list[int] | Exception] = fut) -> None:
                def put() -> None:
                    if not fut.done():
                        fut.set_result(v)

                loop.call_soon_threadsafe(put)

            waiting, refused, seen = header.get("waiting"), header.get("refused") or [], header.get("seen")
            migrate = header.get("migrate") or []
            step = PairStep(
                pair,
                rows,
                hidden,
                done,
                waiting if isinstance(waiting, int) and waiting >= 0 else None,
                [r for r in refused if isinstance(r, list) and len(r) == 2] if isinstance(refused, list) else [],
                migrate=migrate if isinstance(migrate, list) else [],
                seen=seen if isinstance(seen, int) and seen >= 0 else None,
            )
            timeline.mark("a-frame", "-", seq=header.get("seq"), rows=len(rows))
            host.submit(step, [str(r) for r in ends])
            wake()
            await answers.put((fut, step, ""))
    finally:
        writer.cancel()
        host.close_pair(pair)
        wake()


async def _answer(conn: Connection,
                  answers: asyncio.Queue[tuple[asyncio.Future[list[int] | Exception] | None, PairStep | None, str]]
                  ) -> None:
    """A pair session's writer: each frame's answer (tokens or a named error), in frame order."""
    try:
        while True:
            fut, step, message = await answers.get()
            got: list[int] | Exception = RuntimeError(message) if fut is None else await fut
            if isinstance(got, Exception):
                await conn.send({"op": "error", "message": str(got)})
            else:
                assert step is not None
                await conn.send({"op": "tokens", "tokens": got, **step.reply}, step.payload)
                timeline.mark("a-answer", "-", rows=len(step.rows))
    except TransportError:
        return
