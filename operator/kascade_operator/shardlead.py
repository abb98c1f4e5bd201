"""Sharded leadership (settings.shards > 1): replicas hold shards of the services on one Lease per shard.

Every replica runs kopf from the start (its watches and indexes are warm, so taking a shard over costs no
start-up) and acts only on the services of the shards it holds (shardset.py). Beside kopf, every retry period,
`ShardLeader.tick`:
1. one LIST of this operator's Leases (label kascade.io/operator-lease=<lease_name>): the shard Leases
   `<lease_name>-<k>` and every replica's member Lease (its heartbeat, sharding.member_lease_name);
2. expiry as the official client judges it: a Lease whose record (holder, renewTime) has not changed for the
   lease duration, timed on this replica's monotonic clock (no trust in other clocks);
3. renew the held shard Leases and the member Lease (writes guarded by the resourceVersion listed);
4. `sharding.campaign` (pure) -> acquire free shards up to the fair share (guarded writes: of two replicas
   reaching for one shard, one gets a Conflict and reaches for another next period) and give back those beyond
   it: dropped from the ShardSet at once (no new round), the Lease released once the shard's rounds and plan
   drivers are done.
A held shard Lease not renewed within the renew deadline, or one that names another holder, raises
`LeadershipLost` (crash-only, as with one leader: the process exits and the Deployment restarts it). A clean stop
(SIGTERM) releases every held Lease, so the others take its shards within a retry period.

The campaign runs in a thread of its own (leasethread.py: its own loop and API client, so renewals never wait on
kopf's loop, and a replica whose loop is blocked when it loses a shard is fenced); ShardSet changes are carried
into kopf's loop (`ThreadShards`).

Data flow: OperatorSettings -> `lead_shards_then_run(settings, shards, run)` -> kopf `run()` beside
`ShardThread` (`ShardLeader.run_forever()`) -> ThreadShards -> ShardSet.hold/drop in kopf's loop -> handlers and
rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from kascade_operator.kube import Conflict, Kube, NotFound, now_iso
from kascade_operator.leader import LeadershipLost, identity, lease_namespace
from kascade_operator.leasethread import LeaseThread, run_until
from kascade_operator.settings import OperatorSettings
from kascade_operator.sharding import LeaseState, campaign, lease_name, member_lease_name
from kascade_operator.shardset import ShardSet

log = logging.getLogger(__name__)

OWNER, ROLE, SHARD = "kascade.io/operator-lease", "kascade.io/lease-role", "kascade.io/shard"
GC_LEASES = 10  # a member Lease unchanged for this many lease durations is deleted (its replica is gone)


class ShardLeader:
    def __init__(self, settings: OperatorSettings, kube: Kube, shards: ThreadShards) -> None:
        self.s, self.kube, self.set = settings, kube, shards
        self.me, self.ns = identity(settings), lease_namespace(settings)
        self.duration = max(2, round(settings.lease_duration_seconds))  # the Lease stores whole seconds
        self.leased: set[int] = set()  # shard Leases held (a shard being given back is leased, not in the set)
        self.last_renew: dict[int, float] = {}
        self.listed: dict[str, dict[str, Any]] = {}  # Lease name -> its body as last listed or written
        self.observed: dict[str, tuple[tuple[Any, Any], float]] = {}  # name -> (holder, renewTime), since when
        self.stale: list[str] = []  # member Leases to delete

    def _labels(self, k: int | None) -> dict[str, str]:
        base = {OWNER: self.s.lease_name}
        return {**base, ROLE: "member"} if k is None else {**base, ROLE: "shard", SHARD: str(k)}

    def _name(self, k: int | None) -> str:
        return member_lease_name(self.s.lease_name, self.me) if k is None else \
            lease_name(self.s.lease_name, k, self.set.shards)

    async def _write(self, k: int | None, acquire: bool = False, holder: str | None = "") -> bool:
        """Take (`acquire`), renew, or release (`holder` None) the Lease, guarded by the version listed."""
        name, old = self._name(k), self.listed.get(self._name(k))
        spec = dict((old or {}).get("spec") or {})
        t = now_iso()
        if acquire:
            spec.update(acquireTime=t, leaseTransitions=int(spec.get("leaseTransitions") or 0)
                        + (1 if spec.get("holderIdentity") else 0))
        spec.update(holderIdentity=self.me if holder == "" else holder, leaseDurationSeconds=self.duration,
                    renewTime=t)
        meta: dict[str, Any] = {"name": name, "namespace": self.ns, "labels": self._labels(k)}
        if old is not None:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        try:
            self.listed[name] = await self.kube.write_lease(self.ns, body)
            return True
        except (Conflict, NotFound, ApiException, TimeoutError, OSError) as e:
            log.info("%s: Lease %s/%s not written: %s", self.me, self.ns, name, getattr(e, "reason", None) or repr(e))
            return False

    def _observe(self, listed: list[dict[str, Any]], now: float) -> tuple[set[str], dict[int, LeaseState]]:
        live, states = set(), {}
        self.listed = {x["metadata"]["name"]: x for x in listed}
        for x in listed:
            spec, labels = x.get("spec") or {}, x["metadata"].get("labels") or {}
            rec, name = (spec.get("holderIdentity"), spec.get("renewTime")), x["metadata"]["name"]
            if name not in self.observed or self.observed[name][0] != rec:
                self.observed[name] = (rec, now)
            expired = now - self.observed[name][1] > self.duration
            if labels.get(ROLE) == "member":
                if rec[0] and not expired:
                    live.add(str(rec[0]))
                elif now - self.observed[name][1] > GC_LEASES * self.duration and rec[0] != self.me:
                    self.stale.append(name)  # a replica long gone (a new pod gets a new name): deleted
            elif (labels.get(SHARD) or "").isdigit():
                states[int(labels[SHARD])] = LeaseState(rec[0] or None, expired)
        return live, states

    async def tick(self) -> None:
        now = time.monotonic()
        live, states = self._observe(await self.kube.list_leases(self.ns, f"{OWNER}={self.s.lease_name}"), now)
        for k in sorted(self.leased):
            if k in states and states[k].holder != self.me:
                raise LeadershipLost(f"{self.me}: shard {k}'s Lease names {states[k].holder}")
            if k not in self.set.held and self.set.busy(k) == 0:  # given back, and its work is done: release
                if await self._write(k, holder=None):
                    self.leased.discard(k)
                    log.warning("%s released shard %d (Lease %s/%s)", self.me, k, self.ns, self._name(k))
            elif await self._write(k):
                self.last_renew[k] = now
        await self._write(None)
        for name in self.stale:
            with contextlib.suppress(NotFound, Conflict, ApiException, TimeoutError, OSError):
                await self.kube.delete_lease(self.ns, name)
        self.stale.clear()
        plan = campaign(self.me, self.set.shards, live, states, self.leased)
        for k in plan.release & self.set.held:
            log.warning("%s gives back shard %d: %d live replicas share %d shards", self.me, k,
                        len(live | {self.me}), self.set.shards)
            self.set.drop(k)
        for k in sorted(plan.take):
            if await self._write(k, acquire=True):
                self.leased.add(k)
                self.last_renew[k] = time.monotonic()
                log.warning("%s leads shard %d of %d (Lease %s/%s) at %.3f", self.me, k, self.set.shards, self.ns,
                            self._name(k), time.time())
                self.set.hold(k)

    def check_deadline(self) -> None:
        now = time.monotonic()
        for k in self.leased:
            if now - self.last_renew.get(k, now) > self.s.lease_renew_deadline_seconds:
                raise LeadershipLost(f"{self.me} could not renew shard {k}'s Lease {self.ns}/{self._name(k)} within "
                                     f"{self.s.lease_renew_deadline_seconds} s")

    async def run_forever(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self.tick(), self.s.lease_renew_deadline_seconds)
            except (LeadershipLost, asyncio.CancelledError):
                raise
            except Exception as e:  # the API server or the network: the deadline below decides
                log.warning("%s: shard Leases: %s", self.me, getattr(e, "reason", None) or repr(e))
            self.check_deadline()
            await asyncio.sleep(max(0.0, self.s.lease_retry_seconds - (time.monotonic() - t0)))

    async def release_all(self) -> None:
        """A clean stop: stop acting, then give back every Lease (the member Lease too: not counted as live)."""
        for k in list(self.set.held):
            self.set.drop(k)
        for k in sorted(self.leased):
            await self._write(k, holder=None)
        await self._write(None, holder=None)
        log.warning("%s released its shards %s", self.me, sorted(self.leased))


class ThreadShards:
    """The ShardSet as the Lease thread sees it (leasethread.py). `held` is the thread's own record, so a shard
    it just took or gave back counts at once; `hold`/`drop` run in the operator's loop (its events, waiters and
    wake-ups live there); a shard given back is busy until the loop has dropped it (no round of it starts
    after that), then as busy as the loop counts it (a plain int read)."""

    def __init__(self, shards: ShardSet, loop: asyncio.AbstractEventLoop) -> None:
        self._set, self._loop = shards, loop
        self.shards = shards.shards
        self.held: set[int] = set(shards.held)
        self._dropped: set[int] = set()  # drops the operator's loop has carried out

    def hold(self, k: int) -> None:
        self.held.add(k)
        self._dropped.discard(k)
        self._loop.call_soon_threadsafe(self._set.hold, k)

    def drop(self, k: int) -> None:
        self.held.discard(k)

        def dropped() -> None:
            self._set.drop(k)
            if k not in self.held:  # not taken again meanwhile
                self._dropped.add(k)

        self._loop.call_soon_threadsafe(dropped)

    def busy(self, k: int) -> int:
        return self._set.busy(k) if k in self._dropped else 1


class ShardThread(LeaseThread):
    """`ShardLeader.run_forever` in its own thread (leasethread.py)."""

    def __init__(self, settings: OperatorSettings, kubeconfig: str | None, shards: ThreadShards,
                 on_end: Callable[[str], None], fence: Callable[[int], None] = os._exit) -> None:
        super().__init__("shard-leases", settings, kubeconfig, identity(settings), on_end, fence)
        self.shards = shards
        self.leader: ShardLeader | None = None

    @property
    def leading(self) -> bool:
        return bool(self.leader is not None and self.leader.leased)

    async def hold(self, kube: Kube, halt: asyncio.Event) -> str | None:
        self.leader = ShardLeader(self.s, kube, self.shards)
        log.warning("%s: campaigning for %d shards (Leases %s/%s-*)", self.me, self.shards.shards, self.leader.ns,
                    self.s.lease_name)
        ended, failure = await run_until(self.leader.run_forever(), halt)
        if not ended:
            return None
        return str(failure) if failure is not None else f"{self.me}: the shard campaign ended"

    async def release(self, kube: Kube) -> None:
        if self.leader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.leader.release_all(), 10)


async def lead_shards_then_run(settings: OperatorSettings, shards: ShardSet,
                               run: Callable[[], Coroutine[Any, Any, None]], kubeconfig: str | None = None,
                               fence: Callable[[int], None] = os._exit) -> None:
    """kopf (`run()`) beside the shard campaign, which runs in its own thread (ShardThread); raises LeadershipLost
    when a held shard is lost."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    why: list[str] = []

    def on_end(reason: str) -> None:
        why.append(reason)
        loop.call_soon_threadsafe(ended.set)

    leases = ShardThread(settings, kubeconfig, ThreadShards(shards, loop), on_end, fence)
    await asyncio.to_thread(leases.start_and_wait)
    running = asyncio.create_task(run(), name="kopf")
    lost = asyncio.create_task(ended.wait())
    try:
        await asyncio.wait({running, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await running
        leases.stopped()
        await asyncio.to_thread(leases.stop, not ended.is_set())  # a clean stop gives every Lease back
    if ended.is_set():
        raise LeadershipLost(why[0] if why else f"{leases.me}: shard Leases lost")
    running.result()
