"""`kascade operator run`: the Kubernetes operator (kopf) as a foreground process.

Data flow: flags + KASCADE_OPERATOR_* env -> OperatorSettings (errors name the flag/variable) ->
kascade_operator.handlers.build_registry -> kopf.run against the cluster of KUBECONFIG (or in-cluster).
"""

from __future__ import annotations

import click


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
def run(namespaces: tuple[str, ...], interval: float | None, rate_window: float | None, metrics_source: str | None,
        prometheus_url: str | None, engine_token: str | None, metrics_port: int | None, liveness: str | None,
        router_url: str | None) -> None:
    """Reconcile ModelServices and ScalePlans until interrupted (`kascade -v operator run` logs decisions).

    The warm pool's size is its Deployment's (the chart's `pool.replicas`): it refills itself when the
    operator binds a pod; when it is empty the operator creates pods as the slow fallback."""
    import kopf
    from pydantic import ValidationError

    from kascade_operator.handlers import build_registry
    from kascade_operator.settings import OperatorSettings

    overrides = {k: v for k, v in {"namespaces": list(namespaces) or None, "interval_seconds": interval,
                                   "rate_window_seconds": rate_window, "metrics_source": metrics_source,
                                   "prometheus_url": prometheus_url, "engine_token": engine_token,
                                   "metrics_port": metrics_port, "router_url": router_url}.items() if v is not None}
    try:
        settings = OperatorSettings(**overrides)
    except ValidationError as e:
        raise click.UsageError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
    if liveness is not None and not liveness.startswith("http://"):
        raise click.UsageError(f"--liveness {liveness!r}: expected http://HOST:PORT/PATH")
    kopf.run(registry=build_registry(settings), standalone=True, namespaces=settings.namespaces,
             clusterwide=not settings.namespaces, liveness_endpoint=liveness)
