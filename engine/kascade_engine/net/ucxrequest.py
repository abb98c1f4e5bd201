"""UCX requests: posting a tagged send or receive on a ucxx endpoint and waiting for it without spinning, and
keeping a request abandoned in flight alive until UCX completes it. Only `transport_ucx` uses this.

Data flow: `send` / `recv` (a buffer, the connection's tag or a given one) -> ucxx's request-level call
(`_request_api`; ucxx's own `Endpoint.send/recv` where that layout differs, or the endpoint already failed) ->
`settled` waits: spun on for its first `SPIN_S`, then polled -> done, or abandoned by the caller's timeout ->
`_Parked` holds it until UCX completes it (`release_settled` after a close drops the completed ones).

Why not ucxx's own wait: it spins the event loop (`asyncio.sleep(0)` until done), a core per pending receive.
Why park: destroying a request UCX still holds cancels it from the loop's thread, which deadlocks with UCX's
progress thread completing it (see `_Parked`).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import functools
import time
from typing import Any

import numpy as np

SPIN_S = 0.01  # a request pending this long is polled (see settled), not spun on
POLL_MAX_S = 0.001  # asyncio timers are ~1 ms anyway; the act port (pair steps, PD KV) waits between steps


@functools.cache
def _request_api() -> Any:
    """ucxx's request-level calls (`Array`, `Tag`, `TagMaskFull`, `UCXCanceled`), or None where its
    layout differs (then the public `Endpoint.send/recv` are used, spinning as they do)."""
    try:
        from types import SimpleNamespace

        from ucxx._lib.arr import Array
        from ucxx._lib.libucxx import UCXCanceled
        from ucxx.types import Tag, TagMaskFull
    except ImportError:  # pragma: no cover - only with a different ucxx layout
        return None
    return SimpleNamespace(Array=Array, Tag=Tag, TagMaskFull=TagMaskFull, UCXCanceled=UCXCanceled)


async def settled(req: Any) -> None:
    """Wait for a posted ucxx request without spinning the event loop.

    ucxx's own `request.wait()` (without its notifier thread, which binds futures to one event loop and
    hung a transfer here) is `while not completed: await asyncio.sleep(0)`: every pending receive kept
    its process at ~90% of a core (measured: 2.67 s CPU in 3 s with one idle receive posted, 0.11 s
    with none). Every node of a chain has one posted most of the time (the next frame from upstream),
    so on a loaded 2-core host the spinning nodes took the CPU from the ones with work to do, and a
    fault's recovery (re-fetches while the others wait out a timeout) ran many times slower than the
    fault-free baseline (ADR 0012). Here a request is spun on like before for
    its first `SPIN_S` (streaming completes within that), then polled at a tenth of the time waited so
    far, at most every `POLL_MAX_S`: at most ~10% later than it completed, and an idle wait costs
    almost nothing. UCX's progress thread moves the data meanwhile; only the noticing is polled."""
    waited_from: float | None = None
    try:
        while not req.completed:
            now = time.monotonic()
            if waited_from is None:
                waited_from = now
            waited = now - waited_from
            await asyncio.sleep(0 if waited < SPIN_S else min(POLL_MAX_S, waited / 10))
    except BaseException:  # the caller's timeout (or a cancelled task) abandoned it while UCX still has it
        _parked().park(req)
        raise
    req.check_error()


class _Parked:
    """Requests abandoned while still in flight (a receive whose timeout expired, a send to a stalled peer),
    held until UCX completes them (an endpoint's close cancels what it still had), then released.

    Releasing one still in flight is a deadlock: ucxx's destructor cancels it (`RequestTag::cancel` holds the
    request's lock, then `ucp_request_cancel` waits for the worker's lock) while the progress thread, inside
    `ucp_worker_progress` (worker lock held), completes that receive as cancelled and waits for the request's
    lock in `Request::setStatus`. The event loop's thread then spins forever holding the GIL: a chain node
    hung for good after its upstream's silence timed out (stop-first-ucx, ~1 in 25 runs on a loaded 2-core
    host; ADR 0012). The exception of such a timeout holds the
    request (through the waiting frames), so dropping that exception was enough to trigger it.

    One per process, like the UCX worker whose requests it holds (requests outlive their connections and
    transports), made on first use (`_parked`)."""

    def __init__(self) -> None:
        self._requests: set[Any] = set()
        atexit.register(self._keep_at_exit)

    def park(self, req: Any) -> None:
        if not req.completed:
            self._requests.add(req)
        self.release_settled()

    def release_settled(self) -> None:
        """Drop the parked requests UCX has completed (their destructor then cancels nothing)."""
        self._requests.difference_update([r for r in self._requests if r.completed])

    def count(self) -> int:
        self.release_settled()
        return len(self._requests)

    def _keep_at_exit(self) -> None:
        """At interpreter exit the set's contents would be destroyed, in flight or not: the ones UCX still
        holds are leaked instead (the process is ending; its UCX context goes with it)."""
        for r in self._requests:
            if not r.completed:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(r))


@functools.cache
def _parked() -> _Parked:
    return _Parked()


def release_settled() -> None:
    """Drop the parked requests UCX has completed (after an endpoint's close cancelled what it still had)."""
    _parked().release_settled()


def in_flight() -> int:
    """How many abandoned requests UCX still holds (kept alive here until it completes them)."""
    return _parked().count()


def _usable(ep: Any) -> bool:
    """The endpoint is open and in no error state (else ucxx's own calls handle it, see recv)."""
    try:
        ep._ep.raise_on_error()
    except Exception:
        return False
    return not ep.closed


async def send(ep: Any, buf: np.ndarray, tag: int | None = None) -> None:
    """`ep.send(buf)` (under the connection's tag, or `tag` as is), waited on by `settled`."""
    api = _request_api()
    if api is None or not _usable(ep):  # ucxx raises its own error for a closed or failed endpoint
        await (ep.send(buf) if tag is None else ep.send(buf, tag=tag, force_tag=True))
        return
    await settled(ep._ep.tag_send(api.Array(buf), api.Tag(ep._tags["msg_send"] if tag is None else tag)))


async def recv(ep: Any, buf: np.ndarray, tag: int | None = None) -> None:
    """`ep.recv(buf)` (under the connection's tag, or `tag` as is), waited on by `settled`. An endpoint
    that already failed or closed, or a receive UCX cancelled, goes through ucxx's own `recv`: it still
    delivers a message that reached the worker before the endpoint went (or raises as it would)."""
    api = _request_api()
    if api is not None and _usable(ep):
        req = ep._ep.tag_recv(api.Array(buf), api.Tag(ep._tags["msg_recv"] if tag is None else tag), api.TagMaskFull)
        try:
            await settled(req)
            return
        except api.UCXCanceled:
            pass  # e.g. the endpoint closed before a delayed submission went out: ucxx's path decides
    await (ep.recv(buf) if tag is None else ep.recv(buf, tag=tag, force_tag=True))
