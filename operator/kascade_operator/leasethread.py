"""Leases held from a thread of their own: its own event loop and its own API client, so renewals run every retry
period whatever the operator's loop (kopf: watches, indexes, rounds) is doing. In kopf's loop, a replica filling
its indexes at 2,000 nodes missed a 5 s renew deadline: a busy leader lost its Lease, exited, and its standby paid
a cold start.

Data flow: the operator's loop starts a `LeaseThread` (leader.py's one Lease, shardlead.py's shard Leases) ->
the thread's `hold(kube, halt)` campaigns and renews, telling the operator's loop what it gained through
callbacks it marshals with `call_soon_threadsafe` -> either the Leases are lost (`hold` returns why: `on_end(why)`,
then the fence below) or the operator stops (`stop(release)`: `halt` set, the Leases given back on a clean stop).

Crash-only fence: a replica that lost a Lease must stop acting before another may start acting on it, which is
`lease_duration` after the last renewal, at the earliest `lease_duration - renew_deadline` after the loss is
noticed here. The operator's loop calls `stopped()` once it no longer acts; when it has not within half that
margin (the loop is blocked), the thread ends the process (`fence(3)`, os._exit by default: the Deployment
restarts it, as after any crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable

from kascade_operator.kube import Kube
from kascade_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


class LeaseThread(threading.Thread):
    """Base of the election threads: subclasses say how Leases are held (`hold`) and given back (`release`)."""

    def __init__(self, name: str, settings: OperatorSettings, kubeconfig: str | None, me: str,
                 on_end: Callable[[str], None], fence: Callable[[int], None] = os._exit) -> None:
        super().__init__(name=name, daemon=True)
        self.s, self.kubeconfig, self.me, self.on_end, self.fence = settings, kubeconfig, me, on_end, fence
        self.release_on_stop = False
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._halt: asyncio.Event | None = None
        self._ready = threading.Event()
        self._acted = threading.Event()  # the operator's loop no longer acts (stopped() called)

    # -- what a subclass provides (run in the thread's loop) -------------------------------------------
    async def hold(self, kube: Kube, halt: asyncio.Event) -> str | None:
        """Campaign and renew until `halt` is set (None) or a Lease is lost (why)."""
        raise NotImplementedError

    async def release(self, kube: Kube) -> None:
        """Give back the Leases held (a clean stop)."""
        raise NotImplementedError

    @property
    def leading(self) -> bool:
        """Whether this replica holds a Lease (acts on something)."""
        raise NotImplementedError

    # -- the operator's loop's side --------------------------------------------------------------------
    def start_and_wait(self) -> None:
        """Start the thread and block until its loop runs (stop() needs it)."""
        self.start()
        self._ready.wait(30)

    def stopped(self) -> None:
        """The operator's loop no longer acts (kopf cancelled): no fence needed."""
        self._acted.set()

    def stop(self, release: bool, timeout: float = 15.0) -> None:
        """End the thread (blocking); `release`: give the Leases back first (a clean stop)."""
        self.release_on_stop = release
        self._acted.set()
        if self._own_loop is not None and self._halt is not None and self.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                self._own_loop.call_soon_threadsafe(self._halt.set)
        self.join(timeout)

    # -- the thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._own_loop, self._halt = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        try:
            kube = await Kube.connect(self.kubeconfig)
        except Exception as e:  # no kubeconfig, no in-cluster config: the operator's loop waited forever for news
            self.on_end(f"{self.me}: cannot reach the API server for the Lease: {e}")
            return
        try:
            try:
                why = await self.hold(kube, self._halt)
            except Exception as e:  # a bug here must end the replica, as a lost Lease does, not the thread alone
                log.exception("%s: the Lease thread failed", self.me)
                why = f"{self.me}: the Lease thread failed: {type(e).__name__}: {e}"
            if why is not None:
                leading = self.leading
                self.on_end(why)
                if leading:
                    await self._fence(why)
            elif self.release_on_stop:
                await self.release(kube)
        finally:
            await kube.close()

    async def _fence(self, why: str) -> None:
        grace = max(0.5, (self.s.lease_duration_seconds - self.s.lease_renew_deadline_seconds) / 2)
        if not await asyncio.to_thread(self._acted.wait, grace):
            log.critical("%s: %s, and the operator did not stop within %.1f s: exiting before another replica "
                         "may act", self.me, why, grace)
            self.fence(3)


async def run_until(work: Awaitable[None], halt: asyncio.Event) -> tuple[bool, BaseException | None]:
    """Run `work` until it ends on its own or `halt` is set; returns (ended on its own, what it raised)."""
    task, stop = asyncio.ensure_future(work), asyncio.create_task(halt.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        ended = task.done()
    finally:
        for t in (task, stop):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    return ended, None if not ended or task.cancelled() else task.exception()
