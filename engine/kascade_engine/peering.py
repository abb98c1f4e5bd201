"""Peering: how an engine instance forms, changes and ends its cooperation with other engines.

One control call (`cooperate`, CooperateRequest.mode) sets it; EngineInstance.set_cooperate hands it here:
  standby   warm an authenticated connection to the peer ahead (PeerPool), nothing else changes
  live      form the pair (pairsession.form_pair: one connection reused by every step until the pair ends);
            with `zigzag`, the planner's schedule (livepolicy.ZigZagPolicy) decides each step's split
  pipeline  rows hosted here continue on `peer` after the layers held here (HostRows.downstream)
  redirect  requests queued here may go to `peer` too (liveredirect.Forwarder: one session each)
  off       end every cooperation: the pair, the pipeline hop and every redirect session

Data flow: CooperateRequest -> the instance's `pair` / `host.downstream` / `forwarders` / `cooperate`
replaced (old connections closed after the new ones are up) -> `engine.coop` points at the pair or at the
rows hosted here -> the phase settles (live while paired with a resident embedding) -> EngineStatus.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from kascade_engine.live.liveredirect import Forwarder, RedirectHost
from kascade_engine.net.transport import TransportError
from kascade_engine.refusal import InstanceError
from kascade_planner.engine_api import CooperateRequest, EngineStatus, Phase

if TYPE_CHECKING:
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.config import EngineConfig
    from kascade_engine.live.cooperation import HostRows
    from kascade_engine.live.pairclient import PairClient
    from kascade_engine.net.peerpool import PeerPool

log = logging.getLogger(__name__)

# what reaching a peer may raise: each becomes a 502 naming the peer
_UNREACHABLE = (OSError, RuntimeError, ValueError, TransportError, TimeoutError)


class PeeringHost(RedirectHost, Protocol):
    """What peering reads and sets on its engine instance (EngineInstance is one), each time: a dtype
    rebuild at bind replaces its model and engine."""

    config: EngineConfig
    model: LlamaModel
    host: HostRows
    peers: PeerPool
    pair: PairClient | None  # RedirectHost only reads it
    cooperate: dict[str, str]
    forwarders: dict[str, Forwarder]
    downstream_peer: str | None
    _warming: asyncio.Task[None] | None
    phase: Phase

    @property
    def servable(self) -> bool: ...

    def status(self) -> EngineStatus: ...

    def _to(self, phase: Phase) -> None: ...

    def _settle(self) -> None: ...


async def set_cooperate(inst: PeeringHost, req: CooperateRequest) -> EngineStatus:
    """Form (or end) the pair: one authenticated connection to the peer, opened now, reused by every
    step of every request until the pair ends (cooperation.py)."""
    from kascade_engine.live.pairsession import form_pair

    if req.mode == "standby":
        try:
            await inst.peers.warm(req.peer)
        except _UNREACHABLE as e:
            raise InstanceError(502, f"cannot reach peer {req.peer}: {e}", "peer") from None
        return inst.status()
    if req.mode == "redirect":  # queued requests may go to the engine at `peer` (liveredirect.py)
        return await redirect_to(inst, req.peer)
    if req.mode == "off" and inst.forwarders:
        await redirect_to(inst, None)
    if req.mode == "pipeline":  # rows hosted here continue to `peer` after the layers held here
        try:
            down = await form_pair(inst, req.peer)
        except _UNREACHABLE as e:
            raise InstanceError(502, f"cannot pair with peer {req.peer}: {e}", "peer") from None
        old_down, inst.host.downstream = inst.host.downstream, down
        inst.downstream_peer = req.peer
        if old_down is not None:
            await old_down.close()
        return inst.status()
    pair: PairClient | None
    if req.mode != "off" and inst.pair is not None and inst.cooperate.get("peer") == req.peer:
        pair = inst.pair  # same peer: keep the pair (and its split sequences)
    elif req.mode != "off" and not inst.model.complete:
        try:
            pair = await form_pair(inst, req.peer)
        except _UNREACHABLE as e:
            raise InstanceError(502, f"cannot pair with peer {req.peer}: {e}", "peer") from None
    else:
        pair = None
    if pair is not None and req.zigzag is not None:  # the operator's ZigZag setting: planner's schedule
        from kascade_engine.live.livepolicy import ZigZagPolicy
        from kascade_planner.zigzag import PairSetting

        z = req.zigzag
        setting = PairSetting(inst.model.shape.layers, z.load_ratio, z.batches)
        # the schedule's unit is one layer of one full batch: requests fill batches of this engine's budget
        policy = ZigZagPolicy(setting, z.ilp, inst.engine.limits.max_batch_tokens)
        # the ILP can take a while: the full queue's plan now (off the loop), every other queue state's in a
        # background thread; an admission before that is done plans its own state. Awaiting all of them
        # (108 ILPs here) delayed the pair by seconds on a loaded 2-core box.
        await asyncio.to_thread(lambda: policy.targets)
        inst._warming = asyncio.create_task(asyncio.to_thread(policy.warm))
        pair.policy = policy
    if req.mode == "off":  # off ends every cooperation, a pipeline hop included
        await drop_downstream(inst)
    old, inst.pair = inst.pair, pair
    inst.engine.set_hook(pair if pair is not None else inst.host)
    inst.engine.scheduler.whole_prompts = pair is not None  # each step of a split prompt is a round trip
    inst.serving.wake.set()  # a new pair polls its peer once: it may hand us its queued requests
    if old is not None and old is not pair:
        await old.close()
    inst.cooperate = {} if req.mode == "off" else {"peer": req.peer, "mode": req.mode}
    if not inst.cooperate and inst.phase is Phase.LIVE:
        inst._to(Phase.LOADING)
    inst._settle()
    return inst.status()


async def redirect_to(inst: PeeringHost, peer: str | None) -> EngineStatus:
    """Let requests queued here go to `peer` too (liveredirect.py: one session each, on a connection from the
    PeerPool; a session to the same peer is replaced), or stop every session (None: mode off). What a closed
    session's peer still runs comes back here. Status `redirect` lists the peers. It does not touch the pair
    (`cooperate`): a pipeline head hands its queue to the sources while it stays the head."""
    if peer is not None and not inst.servable:
        raise InstanceError(409, f"mode redirect: engine is {inst.phase.value}, not serving or live with a peer",
                            "mode")
    olds = (
        list(inst.forwarders.values())
        if peer is None
        else [inst.forwarders.pop(peer)]
        if peer in inst.forwarders
        else []
    )
    if peer is None:
        inst.forwarders = {}
    for old in olds:
        await old.close()
    if peer is None:
        return inst.status()
    try:
        conn, _ = await inst.peers.take(peer)
        fwd = Forwarder(inst, peer, conn)
        await fwd.start()
    except _UNREACHABLE as e:
        raise InstanceError(502, f"cannot open a redirect session to {peer}: {e}", "peer") from None
    inst.forwarders[peer] = fwd
    return inst.status()


async def drop_downstream(inst: PeeringHost) -> None:
    """End the pipeline hop: rows hosted here no longer go on to a next receiver."""
    down, inst.host.downstream, inst.downstream_peer = inst.host.downstream, None, None
    if down is not None:
        await down.close()
