"""The router process: the aiohttp app (OpenAI routes, /v1/models, /healthz, /readyz; the admin routes
/metrics, /router/v1/demand, /router/v1/routes on their own port when `admin_port` is set, else here) around one
`Proxy`, its `Routes` fed by a `Watcher` (Kubernetes) or by static backends (no cluster: benchmarks, tests, a
single machine). Client connections pass `guard.CappedFactory` (connection cap, header timeout) first.

Data flow: `Router(settings)` -> `start(host, port)` (watch or static table, client session, listening
socket) -> requests -> `Proxy.handle`. aiohttp parses the clients' HTTP in C; engine connections are
`upstream.Upstreams`, which relay streamed chunks from socket to socket without a task per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kascade_planner.engine_tls import engine_tls_context
from kascade_router.auth import ApiKeys
from kascade_router.backends import Routes
from kascade_router.demand import Demand
from kascade_router.guard import CappedFactory, fd_cap, runner_kwargs
from kascade_router.health import Health
from kascade_router.proxy import Proxy
from kascade_router.settings import RouterSettings
from kascade_router.shares import ShareRefresher
from kascade_router.upstream import Upstreams
from kascade_router.watch import Watcher

log = logging.getLogger(__name__)


ROLES = ("colocated", "prefill", "decode")


def _hostport(spec: str, addr: str) -> str:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--backend {spec!r}: {addr!r} is not HOST:PORT")
    return addr


def static_routes(specs: list[str]) -> Routes:
    """`model=[role@]host:port[+data_host:data_port][,...]` per spec: a fixed table (no Kubernetes). A role
    (prefill | decode | colocated, default colocated) and a data address (a prefill engine's data port,
    where its KV leaves) make a disaggregated service."""
    routes = Routes()
    for spec in specs:
        model, sep, addrs = spec.partition("=")
        if not sep or not model or not addrs:
            raise ValueError(
                f"--backend {spec!r}: expected MODEL=HOST:PORT[,...] (each [ROLE@]HOST:PORT[+DATA_HOST:PORT])"
            )
        routes.set_service("static", model, model)
        for i, item in enumerate(a for a in addrs.split(",") if a):
            role, at, rest = item.rpartition("@")
            role = role if at else "colocated"
            if role not in ROLES:
                raise ValueError(f"--backend {spec!r}: role {role!r} in {item!r}: use {', '.join(ROLES)}")
            addr, plus, data = rest.partition("+")
            ann = {"kascade.io/endpoint": _hostport(spec, addr), "kascade.io/loaded": "true"}
            if plus:
                ann["kascade.io/act-endpoint"] = _hostport(spec, data)
            elif role == "prefill":
                raise ValueError(f"--backend {spec!r}: prefill engine {item!r} needs +DATA_HOST:PORT (its data port)")
            routes.set_pod({"metadata": {"namespace": "static", "name": f"{model}-{i}",
                                         "labels": {"kascade.io/model-service": model, "kascade.io/role": role},
                                         "annotations": ann},
                            "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    return routes


class Router:
    def __init__(self, settings: RouterSettings | None = None, routes: Routes | None = None,
                 namespace: str | None = None, kubeconfig: str | None = None) -> None:
        self.s = settings or RouterSettings()
        self.static = routes is not None
        self.routes = routes or Routes()
        self.demand = Demand(self.s.window_s)
        self.ns, self.kubeconfig = namespace, kubeconfig
        self.watcher: Watcher | None = None
        self.upstreams: Upstreams | None = None
        self.proxy: Proxy | None = None
        self.shares: ShareRefresher | None = None
        self.runner: web.AppRunner | None = None
        self.admin_runner: web.AppRunner | None = None
        self.health: Health | None = None
        self.cap: CappedFactory | None = None
        self._servers: list[asyncio.Server] = []
        self.port = 0
        self.admin_port = 0  # the admin listener's port, 0 without one (admin routes on the client port)

    def app(self) -> web.Application:
        """The client port: the OpenAI routes and probes, plus the admin routes unless they have their own port
        (`admin_port`): those list every engine's address and this router's demand."""
        app = web.Application(client_max_size=self.s.max_body_bytes + 1)
        handle = self._handle
        app.router.add_post("/v1/completions", handle)
        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/readyz", self._ready)
        if self.s.admin_port is None:
            self._admin_routes(app)
        return app

    def admin_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/readyz", self._ready)
        self._admin_routes(app)
        return app

    def _admin_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/router/v1/demand", self._demand)
        app.router.add_get("/router/v1/routes", self._table)

    async def start(self, host: str = "127.0.0.1", port: int = 0, sock: Any = None,
                    admin_host: str | None = None) -> Router:
        keys = ApiKeys(self.s.api_keys_file) if self.s.api_keys_file else None  # a bad file: no start
        if not self.static:
            self.watcher = Watcher(self.routes, self.ns)
            await self.watcher.start(self.kubeconfig)
        tls = engine_tls_context(self.s.engine_ca_file)
        self.upstreams = Upstreams(self.s.connect_timeout_s, tls=tls)
        self.health = Health(self.routes, self.s.eject_s, self.s.eject_after_failures, self.s.probe_timeout_s, tls)
        self.proxy = Proxy(self.routes, self.demand, self.s, self.upstreams, health=self.health, keys=keys)
        self.shares = ShareRefresher(self.routes, self.s.live_share_refresh_s, tls, self.s.connect_timeout_s)
        self.shares.start()
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                    shutdown_timeout=self.s.drain_s, **runner_kwargs(self.s.header_timeout_s))
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        self.cap = CappedFactory(self.runner.server, fd_cap(self.s.max_connections), self.s.retry_after_s)
        if sock is not None:
            srv = await loop.create_server(self.cap, sock=sock)
        else:
            srv = await loop.create_server(self.cap, host, port, reuse_address=True)
        self._servers.append(srv)
        self.port = srv.sockets[0].getsockname()[1] if srv.sockets else port
        if self.s.admin_port is not None:
            self.admin_runner = web.AppRunner(self.admin_app(), access_log=None,
                                              **runner_kwargs(self.s.header_timeout_s))
            await self.admin_runner.setup()
            admin = await loop.create_server(CappedFactory(self.admin_runner.server, 256, self.s.retry_after_s,
                                                           "admin"), admin_host or host, self.s.admin_port,
                                             reuse_address=True)
            self._servers.append(admin)
            self.admin_port = admin.sockets[0].getsockname()[1]
        log.info("router listening on %s:%d%s (%s)", host, self.port,
                 f", admin on port {self.admin_port}" if self.admin_port else "",
                 "static backends" if self.static else f"watching namespace {self.ns or '(all)'}")
        return self

    async def wait_synced(self, timeout: float = 30.0) -> None:
        if self.watcher is not None:
            await asyncio.wait_for(self.watcher.synced.wait(), timeout)

    async def close(self) -> None:
        for srv in self._servers:
            srv.close()
        self._servers.clear()
        if self.shares is not None:
            await self.shares.close()
        if self.health is not None:
            await self.health.close()
        for runner in (self.runner, self.admin_runner):
            if runner is not None:
                await runner.cleanup()
        if self.upstreams is not None:
            self.upstreams.close()
        if self.watcher is not None:
            await self.watcher.close()

    # -- routes ---------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.handle(request)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _demand(self, _: web.Request) -> web.Response:
        return web.json_response(self.demand.snapshot())

    async def _ready(self, _: web.Request) -> web.Response:
        ok = self.watcher is None or self.watcher.synced.is_set()
        return web.Response(text="ready" if ok else "syncing", status=200 if ok else 503)

    async def _models(self, request: web.Request) -> web.Response:
        keys = self.proxy.keys if self.proxy is not None else None
        key = keys.lookup(request.headers.get("Authorization")) if keys is not None else None
        if keys is not None and key is None:
            return web.json_response({"error": {"message": "a valid API key is required (Authorization: Bearer KEY)",
                                                "type": "authentication_error", "param": None, "code": 401}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        data = [{"id": m, "object": "model", "owned_by": f"{ns}/{name}"}
                for m, (ns, name) in sorted(self.routes.models.items()) if key is None or key.allows(m)]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.demand.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _table(self, _: web.Request) -> web.Response:
        now = time.monotonic()
        out = {m: {"modelService": f"{svc[0]}/{svc[1]}",
                   "backends": [{"pod": b.pod, "address": b.address, "role": b.role, "data": b.data,
                                 "weight": b.weight, "inFlight": b.in_flight,
                                 # what the ttft rule knows of it (firsttoken.py), null where not measured
                                 "firstTokens": {"waiting": b.first_tokens.waiting,
                                                 "latencySeconds": b.first_tokens.latency(now),
                                                 "ratePerSecond": b.first_tokens.rate_per_s(now)},
                                 "ejected": not b.usable(now)} for b in self.routes.backends.get(svc, {}).values()]}
               for m, svc in self.routes.models.items()}
        return web.json_response(out)
