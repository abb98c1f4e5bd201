"""`kascade operator uninstall`: what the chart's pre-delete hook runs before `helm uninstall` deletes anything.

Every ModelService carries the operator's finalizer (kascade.io/finalizer: a deletion first returns its
engines to the pool). After `helm uninstall` no operator is left to remove it, so deleting a ModelService, or
its namespace, hung for ever (issue 32). The hook, while the operator's RBAC and Service account still exist:

1. stops the operator: its Deployment scaled to 0, then waits (up to `wait_s`) until none of its pods is
   left. A running operator puts the finalizer back at once (kopf adds it to every ModelService it sees
   without one), and would bind pods again;
2. for each ModelService: `plandriver.release_all` (engines drained and released, bound pool pods back to
   the pool, fallback pods and ScalePlans deleted), then the finalizer removed. The ModelServices stay, as
   the CRDs do (Helm never deletes `crds/`); a later install adopts them again.

Each step is best effort: the hook never blocks an uninstall (exit 0 whatever failed). What it could not clean
up is collected (`Leftovers`) and reported at the end: one warning line naming every leftover, and a Warning
Event (reason UninstallIncomplete) on each ModelService concerned and, for the operator and the engine token,
on the operator Deployment, so `kubectl get events` says what an operator must finish by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.rest import ApiException

from kascade_operator import enginetoken, plandriver
from kascade_operator import labels as L
from kascade_operator.engine_client import EngineClient
from kascade_operator.kube import GROUP, MERGE, VERSION, Kube, NotFound
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

INCOMPLETE = "UninstallIncomplete"  # the reason of the Events that name what was left


@dataclass
class Leftovers:
    """What the hook could not clean up, each a sentence naming the object and why: the installation's (the
    operator, the engine token, the ModelService listing) and each ModelService's, by (namespace, name)."""

    installation: list[str] = field(default_factory=list)
    services: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    uids: dict[tuple[str, str], str] = field(default_factory=dict)  # for the Events' involvedObject

    def service(self, body: dict[str, Any], what: str) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        self.services.setdefault(key, []).append(what)
        if meta.get("uid"):
            self.uids[key] = meta["uid"]

    def lines(self) -> list[str]:
        return [*self.installation,
                *(f"ModelService {ns}/{name}: {w}" for (ns, name), ws in self.services.items() for w in ws)]

    def __bool__(self) -> bool:
        return bool(self.installation or self.services)


@dataclass
class Outcome:
    """The hook's result: how many ModelServices it let go (finalizer removed) and what it left."""

    let_go: int = 0
    left: Leftovers = field(default_factory=Leftovers)


async def stop_operator(kube: Kube, ns: str, deployment: str, wait_s: float, me: str = "") -> str | None:
    """Scale the operator Deployment to 0 and wait until its pods are gone (`me`: this pod, never waited
    for). None when it is stopped (or there is none); else why not (not scaled, or pods still running)."""
    apps = client.AppsV1Api(kube.api)
    try:
        dep = await apps.read_namespaced_deployment(deployment, ns, _request_timeout=kube.t)
        await apps.patch_namespaced_deployment_scale(deployment, ns, {"spec": {"replicas": 0}},
                                                     _request_timeout=kube.t)
    except ApiException as e:
        if e.status == 404:
            return None  # no operator Deployment: nothing runs
        log.warning("operator Deployment %s/%s not scaled to 0: %s %s", ns, deployment, e.status, e.reason)
        return f"operator Deployment {ns}/{deployment} not scaled to 0 ({e.status} {e.reason})"
    selector = ",".join(f"{k}={v}" for k, v in sorted((dep.spec.selector.match_labels or {}).items()))
    return await operator_gone(kube, ns, selector, wait_s, me)


async def operator_gone(kube: Kube, ns: str, selector: str, wait_s: float, me: str = "") -> str | None:
    """Wait (up to `wait_s`) until no pod of the operator's selector but `me` is left: None, or which are."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p["metadata"]["name"] for p in await kube.list_pods(ns, selector) if p["metadata"]["name"] != me]
        if not left:
            log.info("operator pods in %s (%s): none left", ns, selector)
            return None
        if time.monotonic() > deadline:
            log.warning("operator pods still running after %.0f s: %s", wait_s, ", ".join(left))
            return f"operator pods in {ns} still running after {wait_s:.0f} s: {', '.join(left)}"
        await asyncio.sleep(1.0)


async def modelservices(kube: Kube, namespaces: list[str]) -> list[dict[str, Any]]:
    if not namespaces:
        doc = await kube.custom.list_cluster_custom_object(GROUP, VERSION, "modelservices", _request_timeout=kube.t)
        return list(doc.get("items") or [])
    out: list[dict[str, Any]] = []
    for ns in namespaces:
        doc = await kube.custom.list_namespaced_custom_object(GROUP, VERSION, ns, "modelservices",
                                                              _request_timeout=kube.t)
        out += doc.get("items") or []
    return out


async def let_go(rt: Runtime, body: dict[str, Any]) -> tuple[bool, list[str]]:
    """Release one ModelService's engines and pods, then remove the operator's finalizer from it. Returns
    whether the finalizer is gone, and what could not be done (empty: all of it)."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    try:
        left = await plandriver.release_all(rt, body)
    except Exception as e:  # best effort: the finalizer goes either way
        log.warning("ModelService %s/%s: releasing its pods: %s", ns, name, e)
        left = [f"its pods not released ({type(e).__name__}: {e})"]
    dropped = await drop_finalizer(rt.kube, ns, name)
    if not dropped:
        left.append(f"finalizer {L.FINALIZER} not removed: delete it by hand, or the ModelService never goes")
    return dropped, left


async def drop_finalizer(kube: Kube, ns: str, name: str, attempts: int = 5) -> bool:
    """Remove the operator's finalizer from a fresh read of the ModelService (releasing its engines, or an
    operator still stopping, changes it: a patch with the version listed before would conflict, 409)."""
    for _ in range(attempts):
        try:
            meta = (await kube.get_modelservice(ns, name))["metadata"]
        except NotFound:  # deleted meanwhile
            return True
        except ApiException as e:
            log.warning("ModelService %s/%s: not read: %s %s", ns, name, e.status, e.reason)
            return False
        left = [f for f in meta.get("finalizers") or [] if f != L.FINALIZER]
        if left == list(meta.get("finalizers") or []):
            return True
        patch = {"metadata": {"finalizers": left, "resourceVersion": meta.get("resourceVersion")}}
        try:
            # a dict goes as a JSON patch by default (400): name the merge patch; the generated stub omits the kwarg
            await kube.custom.patch_namespaced_custom_object(  # type: ignore[call-arg]
                GROUP, VERSION, ns, "modelservices", name, patch, _content_type=MERGE, _request_timeout=kube.t)
            log.info("ModelService %s/%s: finalizer %s removed", ns, name, L.FINALIZER)
            return True
        except ApiException as e:
            if e.status != 409:
                log.warning("ModelService %s/%s: finalizer not removed: %s %s", ns, name, e.status, e.reason)
                return False
    log.warning("ModelService %s/%s: finalizer not removed: it changed on each of %d attempts", ns, name, attempts)
    return False


async def uninstall(settings: OperatorSettings, deployment: str | None, deployment_ns: str, wait_s: float,
                    me: str = "", kubeconfig: str | None = None) -> Outcome:
    """Stop the operator and let every ModelService go; what was left is logged and posted as Events."""
    kube = await Kube.connect(kubeconfig)
    out = Outcome()
    try:
        not_stopped = await stop_operator(kube, deployment_ns, deployment, wait_s, me) if deployment else None
        try:
            token = settings.engine_token or await enginetoken.ensure(
                kube, enginetoken.token_namespace(settings.engine_token_namespace), settings.engine_token_secret,
                False, wait_s=5.0)
        except enginetoken.TokenUnavailable as e:
            log.warning("%s: engines are not released (their pods still are)", e)
            out.left.installation.append(f"engine token unavailable ({e}): no engine was released")
            token = ""
        from kascade_planner.engine_tls import engine_tls_context

        engines = EngineClient(token, settings.engine_timeout_seconds,
                               tls=engine_tls_context(settings.engine_ca_file))
        rt = Runtime(settings, kube, engines, None, None, OperatorMetrics())
        try:
            services = await _listed(kube, settings.namespaces, out.left)
            for body in services:
                dropped, left = await let_go(rt, body)
                out.let_go += int(dropped)
                for what in left:
                    out.left.service(body, what)
            if deployment and not_stopped:
                # an operator still stopping puts the finalizer back (kopf adds it to every ModelService it
                # sees without one): once its pods are gone, take it off again
                not_stopped = await stop_operator(kube, deployment_ns, deployment, wait_s, me)
                for body in await _listed(kube, settings.namespaces, out.left):
                    if not await drop_finalizer(kube, body["metadata"]["namespace"], body["metadata"]["name"]):
                        out.left.service(body, f"finalizer {L.FINALIZER} put back by the running operator")
            if not_stopped:
                out.left.installation.append(not_stopped)
            await report(rt, out.left, deployment, deployment_ns)
        finally:
            await engines.aclose()
        return out
    finally:
        await kube.close()


async def _listed(kube: Kube, namespaces: list[str], left: Leftovers) -> list[dict[str, Any]]:
    """The ModelServices to let go; none (a leftover said) when they cannot be listed."""
    try:
        return await modelservices(kube, namespaces)
    except ApiException as e:
        log.warning("ModelServices not listed: %s %s", e.status, e.reason)
        where = ", ".join(namespaces) or "all namespaces"
        left.installation.append(f"ModelServices in {where} not listed ({e.status} {e.reason}): none was let go")
        return []


async def report(rt: Runtime, left: Leftovers, deployment: str | None, deployment_ns: str) -> None:
    """Say what was left: one warning line, and Warning Events (UninstallIncomplete) on each ModelService
    concerned and, for the installation's leftovers, on the operator Deployment."""
    if not left:
        return
    log.warning("uninstall incomplete; clean up by hand: %s", "; ".join(left.lines()))
    for (ns, name), whats in left.services.items():
        obj = {"metadata": {"name": name, "uid": left.uids.get((ns, name))}}
        await rt.event(ns, obj, "ModelService", "Warning", INCOMPLETE,
                       "kascade operator uninstall could not clean up: " + "; ".join(whats))
    if left.installation and deployment:
        await rt.kube.event(deployment_ns, {"metadata": {"name": deployment}}, "Deployment", "Warning", INCOMPLETE,
                            "kascade operator uninstall could not clean up: " + "; ".join(left.installation),
                            api_version="apps/v1")
