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

Each step is best effort and logged: the hook never blocks an uninstall (a failure is a warning, exit 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
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


async def stop_operator(kube: Kube, ns: str, deployment: str, wait_s: float, me: str = "") -> bool:
    """Scale the operator Deployment to 0 and wait until its pods are gone (`me`: this pod, never waited
    for). False when it could not be stopped in time (or read)."""
    apps = client.AppsV1Api(kube.api)
    try:
        dep = await apps.read_namespaced_deployment(deployment, ns, _request_timeout=kube.t)
        await apps.patch_namespaced_deployment_scale(deployment, ns, {"spec": {"replicas": 0}},
                                                     _request_timeout=kube.t)
    except ApiException as e:
        if e.status == 404:
            return True  # no operator Deployment: nothing runs
        log.warning("operator Deployment %s/%s not scaled to 0: %s %s", ns, deployment, e.status, e.reason)
        return False
    selector = ",".join(f"{k}={v}" for k, v in sorted((dep.spec.selector.match_labels or {}).items()))
    return await operator_gone(kube, ns, selector, wait_s, me)


async def operator_gone(kube: Kube, ns: str, selector: str, wait_s: float, me: str = "") -> bool:
    """Wait (up to `wait_s`) until no pod of the operator's selector but `me` is left."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [p["metadata"]["name"] for p in await kube.list_pods(ns, selector) if p["metadata"]["name"] != me]
        if not left:
            log.info("operator pods in %s (%s): none left", ns, selector)
            return True
        if time.monotonic() > deadline:
            log.warning("operator pods still running after %.0f s: %s", wait_s, ", ".join(left))
            return False
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


async def let_go(rt: Runtime, body: dict[str, Any]) -> None:
    """Release one ModelService's engines and pods, then remove the operator's finalizer from it."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    try:
        await plandriver.release_all(rt, body)
    except Exception as e:  # best effort: the finalizer goes either way
        log.warning("ModelService %s/%s: releasing its pods: %s", ns, name, e)
    await drop_finalizer(rt.kube, ns, name)


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
                    me: str = "") -> int:
    """Returns how many ModelServices were let go."""
    kube = await Kube.connect()
    try:
        stopped = await stop_operator(kube, deployment_ns, deployment, wait_s, me) if deployment else True
        try:
            token = settings.engine_token or await enginetoken.ensure(
                kube, enginetoken.token_namespace(settings.engine_token_namespace), settings.engine_token_secret,
                False, wait_s=5.0)
        except enginetoken.TokenUnavailable as e:
            log.warning("%s: engines are not released (their pods still are)", e)
            token = ""
        from kascade_planner.engine_tls import engine_tls_context

        engines = EngineClient(token, settings.engine_timeout_seconds,
                               tls=engine_tls_context(settings.engine_ca_file))
        rt = Runtime(settings, kube, engines, None, None, OperatorMetrics())
        try:
            services = await modelservices(kube, settings.namespaces)
            for body in services:
                await let_go(rt, body)
            if deployment and not stopped:
                # an operator still stopping puts the finalizer back (kopf adds it to every ModelService it
                # sees without one): once its pods are gone, take it off again
                await stop_operator(kube, deployment_ns, deployment, wait_s, me)
                for body in await modelservices(kube, settings.namespaces):
                    await drop_finalizer(kube, body["metadata"]["namespace"], body["metadata"]["name"])
        finally:
            await engines.aclose()
        return len(services)
    finally:
        await kube.close()
