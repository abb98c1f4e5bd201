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

Data flow: OperatorSettings (lease name/namespace/timings, identity) -> `lead_then_run(run)` ->
waits for the Lease -> `run()` (kopf.operator) until the Lease is lost -> `LeadershipLost`.
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


async def lead_then_run(settings: OperatorSettings, run: Callable[[], Coroutine[Any, Any, None]],
                        liveness: str | None = None, kubeconfig: str | None = None) -> None:
    """Wait for the Lease, then `run()` while holding it; raises LeadershipLost when it is lost (or
    returns when `run()` returns)."""
    kube = await Kube.connect(kubeconfig)
    me, ns = identity(settings), lease_namespace(settings)
    lock = LeaseLock(settings.lease_name, ns, me, kube.api)
    standby = await _standby_liveness(liveness)
    done = asyncio.Event()
    lost: list[bool] = []
    leading: list[bool] = []

    async def started() -> None:
        leading.append(True)
        log.warning("%s leads (Lease %s/%s) at %.3f: starting the operator", me, ns, settings.lease_name, time.time())
        if standby is not None:
            standby.close()
            await standby.wait_closed()
        try:
            await run()
        finally:
            done.set()

    async def stopped() -> None:
        lost.append(True)
        done.set()

    # the Lease stores whole seconds (the client writes str(duration) and reads it back with int())
    cfg = electionconfig.Config(lock, max(2, round(settings.lease_duration_seconds)),
                                settings.lease_renew_deadline_seconds, settings.lease_retry_seconds, started, stopped)
    log.warning("%s: standby, waiting for Lease %s/%s", me, ns, settings.lease_name)
    election = asyncio.create_task(leaderelection.LeaderElection(cfg).run())
    election.add_done_callback(lambda _: done.set())  # an election that dies must not leave us waiting
    try:
        await done.wait()
    finally:
        election.cancel()
        failure: BaseException | None = None
        try:
            await election
        except asyncio.CancelledError:
            pass
        except Exception as e:  # re-raised below as what it means to the caller
            failure = e
        if leading and not lost:  # a clean stop (or run() ended): hand over now, not after the duration
            await release_lease(kube, settings.lease_name, ns, me)
        await kube.close()
    if failure is not None:
        raise LeadershipLost(f"{me}: leader election failed: {failure!r}") from failure
    if lost:
        raise LeadershipLost(f"{me} could not renew Lease {ns}/{settings.lease_name} within "
                             f"{settings.lease_renew_deadline_seconds} s")
