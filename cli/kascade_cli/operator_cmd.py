"""`kascade operator run`: the Kubernetes operator (kopf) as a foreground process.

Data flow: flags + KASCADE_OPERATOR_* env -> OperatorSettings (errors name the flag/variable) ->
kascade_operator.handlers.build_registry -> kopf.run against the cluster of KUBECONFIG (or in-cluster).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from kascade_operator.settings import OperatorSettings


@click.group("operator")
def operator() -> None:
    """Run the Kascade Kubernetes operator."""


@operator.command("run")
@click.option("--namespace", "namespaces", multiple=True, help="watch only this namespace (repeatable; default: all)")
@click.option("--interval", type=float, help="metric loop period in seconds (sub-second allowed)")
@click.option("--rate-window", type=click.FloatRange(0, 60),
              help="seconds of scrapes behind each tokens/s rate (default 1; 0: the last two scrapes)")
@click.option("--metrics-source", type=click.Choice(["scrape", "prometheus"]), help="engine /metrics or Prometheus")
@click.option("--prometheus-url", help="Prometheus base URL (with --metrics-source prometheus)")
@click.option("--engine-token", envvar="KASCADE_ENGINE_TOKEN", help="bearer token for the engine control API")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="serve the operator's /metrics here (0 = off)")
@click.option("--liveness", metavar="URL", help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
@click.option("--router-url", metavar="URL", help="the router's base URL: ModelService status.url and router demand "
              "(scale from zero)")
@click.option("--pool-namespace", help="namespace of the warm pool for every ModelService (default: the service's)")
@click.option("--engine-image", help="the installation's engine image (fallback pods may always use it)")
@click.option("--allowed-image", "allowed_images", multiple=True,
              help="another image fallback pods may use (repeatable; a trailing * is a prefix)")
@click.option("--allowed-host-path-root", "allowed_host_path_roots", multiple=True,
              help="a directory under which spec.model.source.path may be mounted as hostPath (repeatable)")
@click.option("--leader-elect/--no-leader-elect", default=None,
              help="elect one active replica on a Lease (HA); standbys wait")
@click.option("--lease-namespace", help="namespace of the Lease (default: $POD_NAMESPACE, else default)")
@click.option("--lease-duration", type=float, help="seconds a leader's Lease lasts without renewal")
@click.option("--lease-renew-deadline", type=float, help="seconds a leader tries to renew before it steps down")
@click.option("--lease-retry", type=float, help="seconds between Lease attempts")
@click.option("--identity", help="this replica's name in the Lease (default: hostname-pid)")
@click.option("--shards", type=int, help="split the services into this many shards held by the replicas, one Lease "
              "each (with --leader-elect; default 1: one leader)")
def run(
    namespaces: tuple[str, ...],
    interval: float | None,
    rate_window: float | None,
    metrics_source: str | None,
    prometheus_url: str | None,
    engine_token: str | None,
    metrics_port: int | None,
    liveness: str | None,
    pool_namespace: str | None,
    engine_image: str | None,
    allowed_images: tuple[str, ...],
    allowed_host_path_roots: tuple[str, ...],
    leader_elect: bool | None,
    lease_namespace: str | None,
    lease_duration: float | None,
    lease_renew_deadline: float | None,
    lease_retry: float | None,
    identity: str | None,
    router_url: str | None,
    shards: int | None,
) -> None:
    """Reconcile ModelServices and ScalePlans until interrupted (`kascade -v operator run` logs decisions).

    The warm pool's size is its Deployment's (the chart's `pool.replicas`): it refills itself when the
    operator binds a pod; when it is empty the operator creates pods as the slow fallback."""
    import kopf
    from pydantic import ValidationError

    from kascade_operator.handlers import build_registry
    from kascade_operator.settings import OperatorSettings
    from kascade_planner.engine_tls import engine_tls_context

    # values pydantic validates (and reports) below, so typed loosely here
    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "namespaces": list(namespaces) or None,
            "interval_seconds": interval,
            "rate_window_seconds": rate_window,
            "metrics_source": metrics_source,
            "prometheus_url": prometheus_url,
            "engine_token": engine_token,
            "metrics_port": metrics_port,
            "router_url": router_url,
            "pool_namespace": pool_namespace,
            "engine_image": engine_image,
            "allowed_images": list(allowed_images) or None,
            "allowed_host_path_roots": list(allowed_host_path_roots) or None,
            "leader_election": leader_elect,
            "lease_namespace": lease_namespace,
            "lease_duration_seconds": lease_duration,
            "lease_renew_deadline_seconds": lease_renew_deadline,
            "lease_retry_seconds": lease_retry,
            "identity": identity,
            "shards": shards,
        }.items()
        if v is not None
    }
    try:
        settings = OperatorSettings(**overrides)
    except ValidationError as e:
        raise click.UsageError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
    if liveness is not None and not liveness.startswith("http://"):
        raise click.UsageError(f"--liveness {liveness!r}: expected http://HOST:PORT/PATH")
    try:  # the CA of engines serving HTTPS: one that does not load stops the start, not every call later
        engine_tls_context(settings.engine_ca_file)
    except ValueError as e:
        raise click.UsageError(f"KASCADE_OPERATOR_ENGINE_CA_FILE: {e}") from None
    settings = _preflight(settings)
    namespaces_watched = list(settings.namespaces)
    if namespaces_watched and settings.pool_namespace and settings.pool_namespace not in namespaces_watched:
        namespaces_watched.append(settings.pool_namespace)  # the pool's pods are read from a watch
    shard_set = None
    if settings.shards > 1:
        from kascade_operator.shardset import ShardSet
        shard_set = ShardSet(settings.shards)
    kw = dict(registry=build_registry(settings, shard_set), standalone=True, namespaces=namespaces_watched,
              clusterwide=not namespaces_watched, liveness_endpoint=liveness)
    if not settings.leader_election:
        kopf.run(**kw)  # type: ignore[arg-type]
        return
    import asyncio
    import sys

    from kascade_operator.leader import LeadershipLost, lead_then_run

    try:
        if shard_set is not None:
            from kascade_operator.shardlead import lead_shards_then_run
            run_kopf = lambda: kopf.operator(**kw)  # type: ignore[arg-type] # noqa: E731
            asyncio.run(lead_shards_then_run(settings, shard_set, run_kopf))
        else:
            asyncio.run(lead_then_run(settings, lambda: kopf.operator(**kw), liveness))  # type: ignore[arg-type]
    except LeadershipLost as e:
        click.echo(f"kascade operator: {e}; exiting so a standby can lead", err=True)
        sys.exit(3)


@operator.command("uninstall")
@click.option("--deployment", help="the operator Deployment to scale to 0 first (the chart's pre-delete hook names it)")
@click.option("--deployment-namespace", envvar="POD_NAMESPACE", default="default", show_default=True,
              help="its namespace (env POD_NAMESPACE)")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=60.0, show_default=True,
              help="seconds to wait for the operator pods to be gone")
def uninstall(deployment: str | None, deployment_namespace: str, wait_s: float) -> None:
    """Before `helm uninstall`: stop the operator, return every ModelService's engines to the pool and remove
    the operator's finalizer (the ModelServices stay). Settings from KASCADE_OPERATOR_* (watched namespaces,
    pool namespace, engine token Secret). Best effort: always exits 0; what it could not clean up is printed
    and posted as Warning Events (reason UninstallIncomplete) on the ModelServices and the operator Deployment."""
    import asyncio
    import os

    from kascade_operator.settings import OperatorSettings
    from kascade_operator.uninstall import uninstall as run_uninstall

    try:
        out = asyncio.run(run_uninstall(OperatorSettings(), deployment, deployment_namespace, wait_s,
                                        me=os.environ.get("HOSTNAME", "")))
    except Exception as e:  # never block an uninstall: say why and let it go on
        click.echo(f"kascade operator uninstall: nothing cleaned up: {type(e).__name__}: {e}", err=True)
        return
    click.echo(f"kascade operator uninstall: {out.let_go} ModelService(s) let go")
    for line in out.left.lines():
        click.echo(f"kascade operator uninstall: not cleaned up: {line}", err=True)


def _preflight(settings: OperatorSettings) -> OperatorSettings:
    """Before kopf starts: a cluster to talk to and the engine token, or one error line and exit 1 (kopf
    would print a traceback and retry forever). Returns the settings with the token resolved."""
    import asyncio
    import logging
    import sys

    from kascade_operator import enginetoken
    from kascade_operator.kube import Kube, NoCluster

    async def check() -> str | None:
        kube = await Kube.connect()
        try:
            if settings.engine_token:
                return None
            return await enginetoken.ensure(kube, enginetoken.token_namespace(settings.engine_token_namespace),
                                            settings.engine_token_secret, settings.engine_token_create)
        finally:
            await kube.close()

    try:
        token = asyncio.run(check())
    except (NoCluster, enginetoken.TokenUnavailable) as e:
        logging.getLogger(__name__).error("kascade operator: %s", e)  # one line, in the chosen log format
        sys.exit(1)
    return settings.model_copy(update={"engine_token": token}) if token else settings
