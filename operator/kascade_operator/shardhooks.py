"""Where the kopf handlers meet the shards (settings.shards > 1; with one shard none of this runs).

Every replica runs kopf over every object (warm watches for a fast takeover), so each handler first asks whether
the object's shard is held here (Runtime.owns), and:
- ModelService / ModelServiceRole changes of another shard: the handler returns at once, and `OwnedDiffBase` /
  `OwnedProgress` keep kopf from reading or writing its last-handled-configuration annotation and its handler
  progress for them (kopf instances share both: a non-owner's record of its handler's success made the owner's
  kopf skip the handler, measured on the real API server). Their rounds are dropped in rounds.wake / the queue;
- a shard taken over (ShardSet.on_hold) -> `wake_shard`: a round for each of its services (from the watch-fed
  index), as kopf's resume handlers give every service at start-up;
- a ScalePlan's daemon (`drive_owned`): waits until the plan's shard is held here, re-reads the plan (the last
  holder moved it on), drives it, and is cancelled when the shard is given back (the next holder resumes it
  from its status, as after a crash);
- a ModelService deletion (`delete_guard`): only the owner drains and releases its pods; another replica waits a
  retry period and then retries later (kopf.TemporaryError), so its kopf never removes the finalizer first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import kopf

from kascade_operator import labels as L
from kascade_operator import rounds
from kascade_operator.kube import NotFound
from kascade_operator.reconcile import TERMINAL
from kascade_operator.runtime import Runtime


def claims(body: kopf.Body, memo: kopf.Memo, **_: Any) -> bool:
    """kopf `when` of the handlers that make kopf put its finalizer on an object (the delete handler, the plan
    daemon): true in the replica holding the object's shard, and anywhere once the finalizer is on. Measured on the
    real API server: two replicas adding the finalizer to a new object at once left the loser's kopf waiting for
    an event that never came, so the owner never ran the create handler. So only the owner adds it; the others
    match (and so never remove it) once it is there."""
    rt: Runtime | None = getattr(memo, "rt", None)
    meta = body.get("metadata", {})
    return rt is None or rt.owns(str(meta.get("namespace") or "")) or L.FINALIZER in (meta.get("finalizers") or ())


class OwnedDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff-base annotation, written only for objects whose shard this replica holds."""

    def __init__(self, owns: Callable[[str], bool]) -> None:
        super().__init__()
        self._owns = owns

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        if self._owns(str(body.get("metadata", {}).get("namespace") or "")):
            super().store(body=body, patch=patch, essence=essence)


class OwnedProgress(kopf.SmartProgressStorage):
    """kopf's handler progress (annotations + status), read and written only for objects whose shard this replica
    holds: kopf instances share the record (same handler ids), and a non-owner's "succeeded" (its handler returned
    at once) would make the owner's kopf skip the handler."""

    def __init__(self, owns: Callable[[str], bool]) -> None:
        super().__init__()
        self._owns = owns

    def _mine(self, body: kopf.Body) -> bool:
        return self._owns(str(body.get("metadata", {}).get("namespace") or ""))

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        return super().fetch(key=key, body=body) if self._mine(body) else None

    def store(self, *, key: Any, record: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        if self._mine(body):
            super().store(key=key, record=record, body=body, patch=patch)

    def purge(self, *, key: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        if self._mine(body):
            super().purge(key=key, body=body, patch=patch)

    def touch(self, *, body: kopf.Body, patch: kopf.Patch, value: str | None) -> None:
        if self._mine(body):
            super().touch(body=body, patch=patch, value=value)


@contextlib.asynccontextmanager
async def held(rt: Runtime, ns: str) -> AsyncIterator[bool]:
    """Around a round: whether the service's shard is held here, counted as running while it is (ShardSet.busy)."""
    if rt.shards is None:
        yield True
    elif not rt.owns(ns):
        yield False
    else:
        with rt.shards.running(rt.pool_namespace(ns)):
            yield True


def wake_shard(rt: Runtime, k: int) -> None:
    """Queue a round for every service of shard k (just taken over)."""
    if rt.shards is None:
        return
    for key in list(rt.service_index or {}):
        if isinstance(key, tuple) and rt.shards.shard(rt.pool_namespace(key[0])) == k:
            rounds.wake(rt, key[0], key[1])


Driver = Callable[[Runtime, dict[str, Any], kopf.DaemonStopped], Coroutine[Any, Any, None]]


async def drive_owned(rt: Runtime, body: dict[str, Any], stopped: kopf.DaemonStopped, drive: Driver) -> None:
    """Drive the plan while its shard is held here (module docstring); returns when the plan is done or stopped."""
    if rt.shards is None:
        await drive(rt, body, stopped)
        return
    meta = body["metadata"]
    ns, pool_ns = meta["namespace"], rt.pool_namespace(meta["namespace"])
    waited = False
    while not stopped:
        if not rt.shards.owns(pool_ns):
            waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.shards.wait_owned(pool_ns), rt.settings.lease_retry_seconds)
            continue
        if waited:  # its last holder may have moved it on (or finished it) meanwhile
            try:
                body, waited = await rt.kube.get_scaleplan(ns, meta["name"]), False
            except NotFound:
                return
            if (body.get("status") or {}).get("phase") in TERMINAL:
                return
            continue  # held still? The shard may have been given back while the plan was read
        with rt.shards.running(pool_ns):
            run = asyncio.create_task(drive(rt, body, stopped))
            lost = asyncio.create_task(rt.shards.wait_dropped(pool_ns))
            await asyncio.wait({run, lost}, return_when=asyncio.FIRST_COMPLETED)
            lost.cancel()
            if run.done():
                await run
                return
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        waited = True


async def delete_guard(rt: Runtime, ns: str) -> None:
    """Return when this replica owns the service's deletion; raise kopf.TemporaryError when another does."""
    if rt.shards is None or rt.owns(ns):
        return
    pool_ns = rt.pool_namespace(ns)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(rt.shards.wait_owned(pool_ns), rt.settings.lease_retry_seconds)
    if not rt.owns(ns):
        raise kopf.TemporaryError(f"shard {rt.shards.shard(pool_ns)} is held by another replica, which releases "
                                  "the service's pods", delay=rt.settings.lease_retry_seconds)
