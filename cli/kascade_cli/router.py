"""`kascade router`: the OpenAI-compatible front door (see router/kascade_router).

Data flow: flags -> `RouterSettings` (with --engine-ca: HTTPS to engines) -> `Router` watching the cluster
(or `--backend` static routes) -> aiohttp on host:port (admin routes on --admin-port when given); prints
`KASCADE_ROUTER_READY http=<port>[ admin=<port>]` once listening and synced.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import click


@click.command("router")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--namespace", help="watch ModelServices and engine pods in this namespace (default: all)")
@click.option("--kubeconfig", help="outside a cluster (default: $KUBECONFIG)")
@click.option("--backend", "backends", multiple=True,
              help="no Kubernetes: MODEL=[ROLE@]HOST:PORT[+DATA_HOST:PORT][,...] (repeatable; benchmarks, single "
                   "machines); ROLE prefill|decode|colocated, a prefill engine needs its data port")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1))
@click.option("--hold-timeout", default=120.0, show_default=True, type=click.FloatRange(0),
              help="seconds a request waits for a model with no serving replica (scale from zero), then 503")
@click.option("--max-queued", default=256, show_default=True, type=click.IntRange(0),
              help="requests held per model beyond this get 429")
@click.option("--connect-timeout", default=2.0, show_default=True, type=click.FloatRange(0, min_open=True))
@click.option("--read-timeout", default=300.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="longest silence from an engine before the request fails")
@click.option("--attempts", default=4, show_default=True, type=click.IntRange(1),
              help="replicas tried per request (only failures before any byte reached the client)")
@click.option("--live-share-refresh", default=0.25, show_default=True, type=click.FloatRange(0),
              help="seconds between re-reads of a live (still loading) replica's serving share from its engine "
                   "(its router weight); 0: only from its answers")
@click.option("--route", type=click.Choice(["ttft", "share"]), default="ttft", show_default=True,
              envvar="KASCADE_ROUTER_ROUTE", show_envvar=True,
              help="how a replica is picked: ttft, the least expected time to first token from the first tokens "
                   "this router measured (rate and latency per replica; share until measured); share, the least "
                   "(in flight + 1) / weight. Disaggregated decode engines are always picked by share")
@click.option(
    "--engine-ca",
    type=click.Path(dir_okay=False),
    default=lambda: os.environ.get("KASCADE_ROUTER_ENGINE_CA"),
    help="PEM CA of engines started with TLS files: route to them over HTTPS verified by it (names not "
    "checked: engines are pod IPs); env KASCADE_ROUTER_ENGINE_CA; default plain HTTP",
)
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="a client connection with no complete request headers this long after it opened (or after its "
                   "last answer) is closed")
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="a request body not complete this long after its headers gets 408")
@click.option("--max-connections", default=8192, show_default=True, type=click.IntRange(1),
              help="open client connections beyond this get 503 + Retry-After (also kept under RLIMIT_NOFILE)")
@click.option("--first-byte-timeout", default=4.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="a request with no byte from its engine this long probes the engine's /readyz; an engine that "
                   "answers neither is ejected as hung and the request goes to another replica")
@click.option("--probe-timeout", default=2.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="seconds a /readyz probe of a silent engine may take")
@click.option("--eject-after-failures", default=3, show_default=True, type=click.IntRange(1),
              help="an engine whose connections fail before answering this many times in a row is ejected for 5 s "
                   "(a refused connection ejects it at once)")
@click.option("--max-backend-connections", default=1000, show_default=True, type=click.IntRange(1),
              help="connections to one engine at most; a request finding every replica full waits like a held one")
@click.option("--admin-port", type=click.IntRange(0, 65535), default=None, envvar="KASCADE_ROUTER_ADMIN_PORT",
              show_envvar=True, help="serve /metrics, /router/v1/demand and /router/v1/routes on this port only "
                                     "(they list every engine's address); default: on --port")
@click.option("--api-keys-file", type=click.Path(dir_okay=False), default=None, envvar="KASCADE_ROUTER_API_KEYS_FILE",
              show_envvar=True, help="client API keys, one `KEY [MODEL,...]` a line (re-read when it changes); "
                                     "clients send Authorization: Bearer KEY; default: no authentication")
@click.option("--engine-token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="the engine token: the prefill peers the router names carry its signature, which engines started "
                   "with --require-prefill-signature demand (default: $KASCADE_ROUTER_ENGINE_TOKEN, else none)")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              envvar="KASCADE_ROUTER_DRAIN_TIMEOUT", show_envvar=True,
              help="seconds requests in flight get to finish after SIGTERM (the listeners close at once)")
def router(host: str, port: int, namespace: str | None, kubeconfig: str | None, backends: tuple[str, ...],
           max_body_bytes: int, hold_timeout: float, max_queued: int, connect_timeout: float, read_timeout: float,
           attempts: int, live_share_refresh: float = 0.25, route: str = "ttft", engine_ca: str | None = None,
           header_timeout: float = 10.0, body_timeout: float = 30.0, max_connections: int = 8192,
           first_byte_timeout: float = 4.0, probe_timeout: float = 2.0, eject_after_failures: int = 3,
           max_backend_connections: int = 1000, admin_port: int | None = None,
           api_keys_file: str | None = None, drain_timeout: float = 60.0,
           engine_token_file: str | None = None) -> None:
    """Route OpenAI requests by `model` to the serving replicas of each ModelService."""
    from kascade_planner.engine_tls import engine_tls_context
    from kascade_router.server import Router, static_routes
    from kascade_router.settings import RouterSettings

    settings = RouterSettings(max_body_bytes=max_body_bytes, hold_timeout_s=hold_timeout, max_queued=max_queued,
                              connect_timeout_s=connect_timeout, read_timeout_s=read_timeout, attempts=attempts,
                              live_share_refresh_s=live_share_refresh, engine_ca_file=engine_ca or "", route=route,
                              header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                              max_connections=max_connections, first_byte_s=first_byte_timeout,
                              probe_timeout_s=probe_timeout, eject_after_failures=eject_after_failures,
                              max_backend_connections=max_backend_connections, admin_port=admin_port,
                              api_keys_file=api_keys_file or "", drain_s=drain_timeout,
                              engine_token=(Path(engine_token_file).read_text().strip() if engine_token_file
                                            else os.environ.get("KASCADE_ROUTER_ENGINE_TOKEN", "").strip()))
    if settings.api_keys_file:
        from kascade_router.auth import ApiKeys
        try:
            ApiKeys(settings.api_keys_file)  # a bad key file is a usage error now
        except (OSError, ValueError) as e:
            raise click.BadParameter(str(e), param_hint="--api-keys-file") from None
    try:
        engine_tls_context(settings.engine_ca_file)  # a bad CA is a usage error now, not a failure per request
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--engine-ca") from None
    try:
        routes = static_routes(list(backends)) if backends else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None

    async def main() -> None:
        r = await Router(settings, routes, namespace, kubeconfig).start(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await r.wait_synced(60.0)
            admin = f" admin={r.admin_port}" if r.admin_port else ""
            print(f"KASCADE_ROUTER_READY http={r.port}{admin}", flush=True)
            await stop.wait()
        finally:
            await r.close()

    try:  # libuv's event loop when installed (`pip install uvloop`): less CPU per proxied request
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
