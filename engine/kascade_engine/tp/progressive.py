"""A tensor-parallel instance's load by plan, layer by layer: every rank receives its plane in the background while
the instance goes on serving, and rank 0 installs each block on every rank at once, as soon as every rank holds its
verified share of it, so the instance serves its resident prefix while it loads (live pairing), as a TP-1 engine
does.

Data flow, every rank: its `PlaneSpec` -> `PlaneReceiver` (a TransferNode on the rank's own data port; rank 0's in
its event loop, a follower's in a thread with a loop of its own, beside the step loop) records each share as the
relay verifies it -> `report()`: the whole blocks whose share this rank holds (a share the plane leaves out, an
empty part or slice, counts as held), whether its plane failed, its bytes and seconds.
Rank 0 (planload.py) polls: a `Progress` message, every rank answers its report (a collective on the control
group) -> the blocks every rank holds and none installed yet -> an `Install` message naming them: every rank
installs them in that order (`install_ready`: parts, the all-gather and the whole block's digest check per block;
slices, as they are) -> rank 0's model holds exactly the blocks every rank holds, so its resident prefix (what the
scheduler and a live pair run) is the minimum over the ranks. A plane that failed on any rank: `Abort` (every rank
stops receiving; the blocks installed so far stay, as a TP-1 engine's do after a failed transfer, the load error
names the rank). Done when every block is installed and every rank's plane finished; the last reports carry the
per-rank stats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kascade_engine.net.transport import Transport
from kascade_engine.tp.gather import gather_block
from kascade_engine.tp.planes import PlaneSpec, receive_plane
from kascade_engine.tp.rankmodel import RankModel
from kascade_engine.weights.blocks import Block, digest_of
from kascade_planner.tpgroup import share_id

log = logging.getLogger(__name__)


class PlaneReceiver:
    """One rank's plane, received in the background; which whole blocks this rank holds its share of."""

    def __init__(self, ps: PlaneSpec, rank: int, g: int) -> None:
        self.ps, self.rank, self.g = ps, rank, g
        self.shares: dict[str, Block] = {}
        self.error: str | None = None
        self.done = False
        self.bytes_in = 0
        self.seconds = 0.0
        self.gather_s = 0.0
        self._wants = set(ps.spec.plan.model.block_ids)  # this plane's shares (empty ones are left out)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.thread: threading.Thread | None = None

    def share(self, block: str) -> str:
        return share_id(self.ps.mode, block, self.rank, self.g)

    async def run(self, transport: Transport | None = None) -> None:
        """Receive the plane until every share is verified (or it fails: `error`); never raises but cancellation."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()

        def landed(event: dict[str, Any], resident: Mapping[str, Block]) -> None:
            if event.get("event") == "block":
                with self._lock:
                    self.shares[event["block"]] = resident[event["block"]]
                    self.bytes_in = int(event.get("bytes", self.bytes_in))

        try:
            got = await receive_plane(self.ps, transport, landed)
            self.seconds, self.bytes_in = got.seconds, got.bytes_in
            self.done = True
        except Exception as e:  # TransferFailed, a refused spec, a port in use: the load fails on every rank
            self.error = f"{type(e).__name__}: {e}"
            log.error("%s: its plane failed: %s", self.ps.me, self.error)

    def start_thread(self) -> threading.Thread:
        """A follower: receive in a thread of its own (its own asyncio loop) while the rank follows rank 0's steps."""
        self.thread = threading.Thread(target=lambda: asyncio.run(self._cancellable()), daemon=True,
                                       name=f"tp-load-{self.rank}")
        self.thread.start()
        return self.thread

    async def _cancellable(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            self.error = self.error or "cancelled"

    def cancel(self) -> None:
        """Stop receiving (the plan failed on some rank, or the load was given up): frees the data port."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel)

    def ready(self) -> list[str]:
        """The whole blocks whose share this rank holds, verified (a share its plane leaves out counts)."""
        with self._lock:
            return [b for b in self.ps.whole if self.share(b) in self.shares or self.share(b) not in self._wants]

    def report(self) -> dict[str, Any]:
        return {"rank": self.rank, "ready": self.ready(), "error": self.error, "done": self.done,
                "bytes": self.bytes_in, "seconds": self.seconds, "gatherSeconds": self.gather_s}


def install_ready(model: RankModel, rx: PlaneReceiver, blocks: Sequence[str], group: dist.ProcessGroup | None = None,
                  device: torch.device | None = None, keep: list[Block] | None = None) -> None:
    """Install `blocks` (every rank holds its share of each; every rank calls this with the same list: parts gather,
    a collective per block). Parts: a whole block whose digest fails after the gather raises GatherError on every
    rank (the instance fails). `keep`: rank 0 keeps the gathered whole blocks (a source of the next plan)."""
    g, rank, whole = rx.g, rx.rank, rx.ps.whole
    with rx._lock:  # parts: the shares go once gathered (the whole block's slices are kept)
        shares = {b: (rx.shares.get if rx.ps.mode == "slices" else rx.shares.pop)(rx.share(b), None) for b in blocks}
    if rx.ps.mode == "slices":
        for b in blocks:
            sid = rx.share(b)
            model.add_sliced(shares[b] or Block(sid, memoryview(b""), (), digest_of(b"")))
        return
    t0 = time.perf_counter()
    for b in blocks:
        part = shares[b]
        blk = gather_block(b, whole[b], part.data if part is not None else b"", rank, g, group, device)
        model.add_block(b, blk.tensors())
        if keep is not None:
            keep.append(blk)
    rx.gather_s += time.perf_counter() - t0


def common_ready(reports: Sequence[Mapping[str, Any]], order: Sequence[str], installed: set[str]) -> list[str]:
    """The blocks, in `order`, every rank holds its share of and none installed yet."""
    held = [set(r["ready"]) for r in reports]
    return [b for b in order if b not in installed and all(b in h for h in held)]


def failures(reports: Sequence[Mapping[str, Any]]) -> str | None:
    bad = [f"rank {r['rank']}: {r['error']}" for r in reports if r.get("error")]
    return "; ".join(bad) or None
