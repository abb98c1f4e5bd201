"""High availability: replicas elect one leader on a coordination.k8s.io Lease; only the leader runs the
operator (kopf). A standby waits, serving only its liveness endpoint; when the leader dies it takes
the Lease after `lease_duration_seconds` and starts kopf, which resumes every in-flight ScalePlan from
its status (each engine is told exactly once: plandriver). A leader that cannot renew the Lease within
`lease_renew_deadline_seconds` exits at once (crash-only: it stops acting before anyone else may
start; the Deployment restarts it as a standby). A leader that stops cleanly (SIGTERM: a rolling
update, a drained node) releases the Lease, so a standby leads within one retry period instead of
waiting out the lease duration.

Uses the election of the official client (kubernetes_asyncio.leaderelection, the Go client's
algorithm: resourceVersion-guarded Lease updates). kopf's own peering was measured beside it
(bench/operator_peering.py, docs/operator.md): about as fast at equal timings, but replicas with one
priority (one Deployment template) all pause, and a kopf leader is never fenced.

Data flow: OperatorSettings (lease name/namespace/timings, identity) -> `lead_then_run(run)` -> the election
in its own thread and event loop (`ElectionThread`: renewals never wait on kopf's loop) -> leading: `run()`
(kopf.operator) in the operator's loop until the Lease is lost -> `LeadershipLost` (or, when the operator's
loop is too busy to stop in time, the thread's fence ends the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlparse

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

from kascade_operator.kube import Kube
from kascade_operator.leasethread import LeaseThread, run_until
from kascade_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed in time: this replica must stop acting."""


def identity(settings: OperatorSettings) -> str:
    return settings.identity or f"{socket.gethostname()}-{os.getpid()}"


def lease_namespace(settings: OperatorSettings) -> str:
    return settings.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"


async def _standby_liveness(url: str | None) -> asyncio.AbstractServer | None:
    """A standby is alive while it waits: answer the liveness probe (kopf serves it once leading)."""
    if not url:
        return None
    u = urlparse(url)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readline()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 8\r\n"
                         b"Connection: close\r\n\r\nstandby\n")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, u.hostname or "0.0.0.0", u.port or 8080)


async def release_lease(kube: Kube, name: str, ns: str, me: str) -> bool:
    """Give up the Lease if `me` still holds it: holderIdentity cleared, guarded by the resourceVersion
    read (never clears a successor's record). True when released."""
    api = client.CoordinationV1Api(kube.api)
    try:
        lease = await api.read_namespaced_lease(name, ns, _request_timeout=5)
        if lease.spec is None or lease.spec.holder_identity != me:
            return False
        await api.patch_namespaced_lease(name, ns, {"metadata": {"resourceVersion": lease.metadata.resource_version},
                                                    "spec": {"holderIdentity": None}},
                                         _content_type="application/merge-patch+json",  # type: ignore[call-arg]
                                         _request_timeout=5)
    except (ApiException, TimeoutError) as e:  # a standby then waits out the lease duration, as after a crash
        log.warning("%s: Lease %s/%s not released: %s", me, ns, name, getattr(e, "reason", None) or repr(e))
        return False
    log.warning("%s released Lease %s/%s", me, ns, name)
    return True


class ElectionThread(LeaseThread):
    """The official client's election (one Lease) in its own thread (leasethread.py); `on_lead()` is told once
    this replica leads."""

    def __init__(self, settings: OperatorSettings, kubeconfig: str | None, on_lead: Callable[[], None],
                 on_end: Callable[[str], None], fence: Callable[[int], None] = os._exit) -> None:
        super().__init__("lease-election", settings, kubeconfig, identity(settings), on_end, fence)
        self.ns, self.on_lead = lease_namespace(settings), on_lead
        self._leading = self._lost = False

    @property
    def leading(self) -> bool:
        return self._leading  # also once the Lease is lost: the operator acted until now (the fence's question)

    async def hold(self, kube: Kube, halt: asyncio.Event) -> str | None:
        async def lead() -> None:
            self._leading = True
            self.on_lead()

        async def end() -> None:
            self._lost = True

        # the Lease stores whole seconds (the client writes str(duration) and reads it back with int())
        cfg = electionconfig.Config(LeaseLock(self.s.lease_name, self.ns, self.me, kube.api),
                                    max(2, round(self.s.lease_duration_seconds)), self.s.lease_renew_deadline_seconds,
                                    self.s.lease_retry_seconds, lead, end)
        ended, failure = await run_until(leaderelection.LeaderElection(cfg).run(), halt)
        if not ended:
            return None
        if failure is not None:
            return f"leader election failed: {failure!r}"
        return f"could not renew Lease {self.ns}/{self.s.lease_name} within {self.s.lease_renew_deadline_seconds} s"

    async def release(self, kube: Kube) -> None:
        if self._leading and not self._lost:  # hand over now, not after the duration
            await release_lease(kube, self.s.lease_name, self.ns, self.me)


async def lead_then_run(settings: OperatorSettings, run: Callable[[], Coroutine[Any, Any, None]],
                        liveness: str | None = None, kubeconfig: str | None = None,
                        fence: Callable[[int], None] = os._exit) -> None:
    """Wait for the Lease, then `run()` while holding it; raises LeadershipLost when it is lost (or
    returns when `run()` returns). The election runs in its own thread (ElectionThread)."""
    loop = asyncio.get_running_loop()
    leads, ended = asyncio.Event(), asyncio.Event()
    why: list[str] = []

    def on_end(reason: str) -> None:
        why.append(reason)
        loop.call_soon_threadsafe(ended.set)

    def on_lead() -> None:
        loop.call_soon_threadsafe(leads.set)

    election = ElectionThread(settings, kubeconfig, on_lead, on_end, fence)
    standby = await _standby_liveness(liveness)
    log.warning("%s: standby, waiting for Lease %s/%s", election.me, election.ns, settings.lease_name)
    await asyncio.to_thread(election.start_and_wait)
    try:
        waits = {asyncio.create_task(leads.wait()), asyncio.create_task(ended.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for t in waits:
            t.cancel()
        if ended.is_set():
            raise LeadershipLost(f"{election.me}: {why[0] if why else 'leader election ended'}")
        log.warning("%s leads (Lease %s/%s) at %.3f: starting the operator", election.me, election.ns,
                    settings.lease_name, time.time())
        if standby is not None:
            standby.close()
            await standby.wait_closed()
            standby = None
        running = asyncio.create_task(run())
        lost = asyncio.create_task(ended.wait())
        try:
            await asyncio.wait({running, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running
            election.stopped()
        if ended.is_set():
            raise LeadershipLost(f"{election.me}: {why[0] if why else 'leader election ended'}")
        running.result()  # run() raised: re-raised here (after the Lease is handed over below)
    finally:
        if standby is not None:
            standby.close()
        # a clean stop (or run() ended) hands the Lease over now, not after the duration; whether it holds one is
        # decided in the election's thread (`release`): read here, a Lease won meanwhile was kept to its duration
        await asyncio.to_thread(election.stop, not ended.is_set())
