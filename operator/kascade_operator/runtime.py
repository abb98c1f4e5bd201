"""Everything the handlers share at run time: API client, engine client, metrics source, settings,
per-ModelService memory (scale-down timers), the cluster state kept current by watches, and operator
metrics.

Data flow: created once in the kopf startup handler, stored in kopf's memo, closed at cleanup. Reads
of pool pods and ScalePlans come from kopf indexes (watch-fed, in memory) once `attach()` got
them from the first handler call; nodes from nodefacts.NodeFacts (a list + watch of its own,
started by `watch_nodes()` at start-up; readers wait for its first list). Without them (tests
that call handlers directly) they are listed from the API server. Writes always go to the API
server, guarded by resourceVersion, so a stale read costs a 409 and a re-read, never a double binding.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kascade_operator import labels as L
from kascade_operator.demand import RouterDemand
from kascade_operator.engine_client import EngineClient
from kascade_operator.fleetboard import FleetBoard
from kascade_operator.kube import Kube
from kascade_operator.metrics import PrometheusSource, Scraper
from kascade_operator.metricsview import MetricsView
from kascade_operator.nodefacts import NodeFacts
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.pool import PodView, pod_view
from kascade_operator.settings import OperatorSettings
from kascade_operator.shardset import ShardSet
from kascade_operator.snapshots import PlanSnapshot, PoolSnapshot, cached, group_plans, group_pool
from kascade_operator.validation import max_gpus
from kascade_operator.workqueue import WorkQueue
from kascade_planner.arbitration import ArbitrationConfig
from kascade_planner.topology import LabelKeys, Topology, topology_from_nodes

RESERVE_S = 30.0  # a claim outlives any bind that is going to happen
EXPECT_S = 60.0  # a created pod the watch has not shown after this long is no longer expected
OWN_PLAN_S = 60.0  # a ScalePlan created here stands in for the index's copy until the watch shows it, this long
EVENT_BURST, EVENT_REFILL_S = 3, 30.0  # Events per (object, reason): a burst of 3, then one per 30 s
NODE_CACHE_S = 2.0  # without the node watch: node labels change rarely; listing 2,000 nodes each time would dominate
NODES_READY_S = 60.0  # a round waits this long for the node watch's first list, then fails (and is retried)


@dataclass
class Runtime:
    settings: OperatorSettings
    kube: Kube
    engines: EngineClient
    scraper: Scraper | None
    prometheus: PrometheusSource | None
    metrics: OperatorMetrics
    below_since: dict[tuple[str, str, str], float | None] = field(default_factory=dict)
    invalid_seen: dict[tuple[str, str], int] = field(default_factory=dict)  # (ns, name) -> generation reported
    last_round: dict[tuple[str, str], float] = field(default_factory=dict)  # (ns, name) -> monotonic time
    # services the metric sweep woke (their loads changed): their next round runs even within 0.95 interval
    metric_woken: set[tuple[str, str]] = field(default_factory=set)
    plan_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    instructed: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # this process's record
    _nodes: list[dict[str, Any]] = field(default_factory=list)
    _nodes_t: float = -1e9
    _facts: tuple[dict[str, str], int] | None = None
    _labels: tuple[object, Mapping[str, Mapping[str, str]]] = (None, {})
    _facts_t: float = -1e9
    _topo: tuple[list[dict[str, Any]], LabelKeys, float, Topology] | None = None  # topology(): the last one built
    _views: dict[tuple[str, str, str | None], PodView] = field(default_factory=dict)
    _snaps: dict[Any, Any] = field(default_factory=dict)  # snapshots.cached: pool and plans per namespace
    parsed: dict[tuple[str, str], Any] = field(default_factory=dict)  # observe.parse: the last spec parsed
    _reserved: dict[tuple[str, str], float] = field(default_factory=dict)  # (ns, pod) -> when claimed
    _expected: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)  # (pool ns, key) -> pod -> t
    _own_plans: dict[tuple[str, str], tuple[float, dict[str, Any]]] = field(default_factory=dict)  # not in the index
    _event_tokens: dict[tuple[str, str, str, str], tuple[float, float]] = field(default_factory=dict)
    events_suppressed: int = 0
    # kopf indexes (Mapping[key, Store]): pool pods and ScalePlans by namespace
    pod_index: Mapping[Any, Any] | None = None
    plan_index: Mapping[Any, Any] | None = None
    node_watch: NodeFacts | None = None  # the nodes (watch_nodes), else listed every NODE_CACHE_S
    node_task: asyncio.Task[None] | None = None
    role_index: Mapping[Any, Any] | None = None  # ModelServiceRole objects by namespace
    router: RouterDemand | None = None  # the router's demand per ModelService (settings.router_url)
    last_busy: dict[tuple[str, str, str], float] = field(default_factory=dict)  # last request/token seen
    host_copy_checked: dict[tuple[str, str], float] = field(default_factory=dict)  # (pool ns, pod) -> when read
    # (pool ns, pod) -> (next check, backoff) of a pod dropped as unhealthy (recovery.py)
    health_retry: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    # (ns, name, role) -> the (current, desired) last logged at INFO and when (a repeated decision logs at DEBUG)
    decision_logged: dict[tuple[str, str, str], tuple[int, int, float]] = field(default_factory=dict)
    # (node, model) -> when an engine there refused bind source.nodeCopy (its node holds no usable copy, or it has no
    # node cache): targets on that node stream again for a while (plandriver.NODE_COPY_RETRY_S)
    node_copy_refused: dict[tuple[str, str], float] = field(default_factory=dict)
    # event-driven rounds (handlers.py): the queue of services due a round, the shared metric sweep's view,
    # and per service (ns, name) its interval and whether its last round left it steady (resync only)
    queue: WorkQueue | None = None
    view: MetricsView | None = None
    steady: dict[tuple[str, str], tuple[float, bool]] = field(default_factory=dict)
    service_index: Mapping[Any, Any] | None = None  # ModelService bodies by (namespace, name)
    sweep_task: asyncio.Task[None] | None = None
    fleet: dict[str, FleetBoard] = field(default_factory=dict)  # pool namespace -> its services' asks
    shards: ShardSet | None = None  # settings.shards > 1: the shards held here (shardlead.py); None: every service

    def owns(self, ns: str) -> bool:
        """Services of namespace `ns` get rounds here: always with one shard, else when their pool's shard is held."""
        return self.shards is None or self.shards.owns(self.pool_namespace(ns))

    def fleet_board(self, pool_ns: str) -> FleetBoard:
        return self.fleet.setdefault(pool_ns, FleetBoard())

    @property
    def arbitration(self) -> ArbitrationConfig:
        s = self.settings
        return ArbitrationConfig(s.arbitration_hysteresis_seconds, s.arbitration_max_preemptions)

    def attach(self, pods: Mapping[Any, Any] | None, plans: Mapping[Any, Any] | None,
               roles: Mapping[Any, Any] | None = None) -> None:
        """Adopt kopf's indexes (the same objects for the operator's lifetime)."""
        if self.pod_index is None:
            self.pod_index, self.plan_index, self.role_index = pods, plans, roles

    def watch_nodes(self) -> NodeFacts:
        """Start keeping the nodes by list + watch (nodefacts.py); stopped by close()."""
        if self.node_watch is None:
            self.node_watch = NodeFacts(self.settings.leaf_label, self.settings.gpu_resource)
            self.node_task = asyncio.create_task(self.node_watch.run(self.kube), name="node-watch")
        return self.node_watch

    async def _nodes_ready(self, watch: NodeFacts) -> None:
        if not watch.ready.is_set():
            try:
                await asyncio.wait_for(watch.ready.wait(), NODES_READY_S)
            except TimeoutError:
                raise RuntimeError(f"the nodes are not listed after {NODES_READY_S:.0f} s (see the node watch's "
                                   "warnings: RBAC list/watch on nodes, the API server)") from None

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node (name, labels, allocatable, capacity); do not modify the list."""
        if self.node_watch is not None:
            await self._nodes_ready(self.node_watch)
            return self.node_watch.node_list()
        now = time.monotonic()
        if now - self._nodes_t > NODE_CACHE_S:
            self._nodes, self._nodes_t = await self.kube.list_nodes(), now
        return self._nodes

    def topology(self, nodes: list[dict[str, Any]]) -> Topology:
        """The planner's topology of `nodes` (a list from `nodes()`): parsed once per node list (the same list
        object until a node changes) instead of per plan (2,000 nodes: ~10 ms of the event loop per plan)."""
        keys, ratio = self.settings.label_keys, self.settings.inter_leaf_ratio
        t = self._topo
        if t is None or t[0] is not nodes or t[1] != keys or t[2] != ratio:
            t = self._topo = (nodes, keys, ratio, topology_from_nodes(nodes, keys, ratio))
        return t[3]

    async def node_facts(self) -> tuple[dict[str, str], int]:
        """(node -> leaf label, most GPUs on a node), recomputed at most every NODE_CACHE_S: every round
        needs them, and walking 2,000 nodes per round would dominate. From the node watch: recomputed only
        after a node changed."""
        if self.node_watch is not None:
            await self._nodes_ready(self.node_watch)
            return self.node_watch.facts()
        now = time.monotonic()
        if self._facts is None or now - self._facts_t > NODE_CACHE_S:
            nodes = await self.nodes()
            leaf = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}).get(self.settings.leaf_label, "")
                    for n in nodes}
            if self._facts is not None and self._facts[0] == leaf:
                leaf = self._facts[0]  # the same object while unchanged: the pool snapshot stays valid
            self._facts, self._facts_t = (leaf, max_gpus(nodes, self.settings.gpu_resource)), now
        return self._facts

    async def node_labels(self) -> Mapping[str, Mapping[str, str]]:
        """node -> its labels (the fleet's node classes, fleettargets.py), rebuilt only when the node list is a
        new object (the node watch hands out the same list until a node changes)."""
        nodes = await self.nodes()
        if self._labels[0] is not nodes:
            # the slim nodes' own label dicts (not copies: 10,000 nodes' labels twice was ~6 MB)
            self._labels = (nodes, {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in nodes})
        return self._labels[1]

    async def pool_snapshot(self, ns: str) -> PoolSnapshot:
        """The pool of `ns` grouped by service, rebuilt only when the index changed (snapshots.py)."""
        leaf, _ = await self.node_facts()
        raw = await self.pool_pods(ns)

        def build() -> PoolSnapshot:
            live = [p for p in raw if not (p.get("metadata") or {}).get("deletionTimestamp")]
            by_raw = dict(zip(map(id, live), self.pod_views(raw, leaf), strict=True))  # deleted pods: no view
            return group_pool(raw, [by_raw.get(id(p)) for p in raw])
        snap: PoolSnapshot = cached(self._snaps, ("pool", ns), raw, leaf, build)
        return snap

    async def plan_snapshot(self, ns: str) -> PlanSnapshot:
        """The ScalePlans of `ns` by service and the pods unfinished ones hold, rebuilt only on a change."""
        plans = await self.scaleplans(ns)
        snap: PlanSnapshot = cached(self._snaps, ("plans", ns), plans, None, lambda: group_plans(plans))
        return snap

    def pod_views(self, raw: list[dict[str, Any]], leaf: Mapping[str, str]) -> list[PodView]:
        """PodViews of live pods, parsed once per pod version (each round sees every pool pod)."""
        out, seen = [], set()
        for p in raw:
            meta = p.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            key = (
                str(meta.get("name")),
                str(meta.get("resourceVersion", "")),
                leaf.get((p.get("spec") or {}).get("nodeName") or ""),
            )
            seen.add(key)
            v = self._views.get(key)
            if v is None:
                v = self._views[key] = pod_view(p, leaf)
            out.append(v)
        if len(self._views) > 4 * len(seen) + 64:  # drop versions no longer seen
            self._views = {k: v for k, v in self._views.items() if k in seen}
        return out

    def reserve(self, ns: str, pods: Iterable[str]) -> None:
        """Claim pods for a plan about to be created (synchronously after the choice, before any await):
        every other service's round in this process skips them until their binding is visible."""
        now = time.monotonic()
        for p in pods:
            self._reserved[(ns, p)] = now

    def unreserve(self, ns: str, pods: Iterable[str]) -> None:
        """Give back claims of a plan that was never created, or that failed (its targets went back to the pool)."""
        for p in pods:
            self._reserved.pop((ns, p), None)

    def reserved(self, ns: str) -> set[str]:
        """Pods claimed less than RESERVE_S ago. Claims expire by age only: a round that saw the pod bound
        must not free it for a round still holding an older view."""
        now = time.monotonic()
        for key in [k for k, t in self._reserved.items() if now - t > RESERVE_S]:
            del self._reserved[key]
        return {p for (n, p) in self._reserved if n == ns}

    def pool_namespace(self, ns: str) -> str:
        """Where the warm pool of a service in `ns` lives (setting; default: the service's namespace)."""
        return self.settings.pool_namespace or ns

    def expect(self, pool_ns: str, key: str, pods: Iterable[str]) -> None:
        """Fallback pods just created for service `key`: counted until the watch shows them."""
        now = time.monotonic()
        self._expected.setdefault((pool_ns, key), {}).update({p: now for p in pods})

    def expected(self, pool_ns: str, key: str, seen: Iterable[str]) -> int:
        """Pods created for `key` that the pod index does not hold yet (a created pod is counted once:
        here until seen, then as a pending pod of the pool)."""
        exp = self._expected.get((pool_ns, key))
        if not exp:
            return 0
        now, seen_set = time.monotonic(), set(seen)
        for pod in [p for p, t in exp.items() if p in seen_set or now - t > EXPECT_S]:
            del exp[pod]
        return len(exp)

    async def event(self, ns: str, obj: dict[str, Any], kind: str, etype: str, reason: str, message: str) -> bool:
        """Post an Event unless (object, reason) used up its budget (a burst, then one per refill
        period): a condition that holds for minutes must not write an Event every round."""
        key = (ns, kind, str((obj.get("metadata") or {}).get("name")), reason)
        now = time.monotonic()
        tokens, t = self._event_tokens.get(key, (float(EVENT_BURST), now))
        tokens = min(float(EVENT_BURST), tokens + (now - t) / EVENT_REFILL_S)
        if tokens < 1.0:
            self._event_tokens[key] = (tokens, now)
            self.events_suppressed += 1
            return False
        self._event_tokens[key] = (tokens - 1.0, now)
        await self.kube.event(ns, obj, kind, etype, reason, message)
        return True

    async def pool_pods(self, ns: str) -> list[dict[str, Any]]:
        """Every warm-pool pod of the namespace, idle or bound."""
        if self.pod_index is not None:
            return list(self.pod_index.get(ns, ()))
        return await self.kube.list_pods(ns, L.POOL)

    async def scaleplans(self, ns: str) -> list[dict[str, Any]]:
        """The namespace's ScalePlans: the watch's, plus those this process created that the watch has not shown
        yet (read your own writes: under load the watch lagged a created plan by tens of seconds, and the
        service's next round, seeing neither the plan nor its target bound, planned the same scale-up again)."""
        if self.plan_index is not None:
            listed = list(self.plan_index.get(ns, ()))
            if not any(n == ns for n, _ in self._own_plans):  # the common case: no set of every plan's name
                return listed
            return listed + self._unseen_own_plans(ns, {p["metadata"]["name"] for p in listed})
        return await self.kube.list_scaleplans(ns)

    def created_plan(self, ns: str, body: dict[str, Any]) -> None:
        """A ScalePlan this process just created (the API server's answer): in `scaleplans` until the watch
        shows it, or OWN_PLAN_S."""
        self._own_plans[(ns, body["metadata"]["name"])] = (time.monotonic(), body)

    def _unseen_own_plans(self, ns: str, listed: set[str]) -> list[dict[str, Any]]:
        now, out = time.monotonic(), []
        for (n, name), (t, body) in list(self._own_plans.items()):
            if now - t > OWN_PLAN_S or (n == ns and name in listed):
                del self._own_plans[(n, name)]
            elif n == ns:
                out.append(body)
        return out

    async def role_objects(self, ns: str) -> list[dict[str, Any]]:
        """The ModelServiceRole objects of the namespace (per-role scale handles)."""
        if self.role_index is not None:
            return list(self.role_index.get(ns, ()))
        return await self.kube.list_modelserviceroles(ns)

    def pool_namespaces(self) -> list[str]:
        """Namespaces holding warm-pool pods (from the index; empty without it)."""
        if self.settings.pool_namespace:
            return [self.settings.pool_namespace]
        return [k for k in (self.pod_index or {}) if isinstance(k, str)]

    def plan_namespaces(self) -> list[str]:
        """Namespaces holding ScalePlans (from the index; empty without it)."""
        return [k for k in (self.plan_index or {}) if isinstance(k, str)]

    def lock(self, ns: str, name: str) -> asyncio.Lock:
        return self.plan_locks.setdefault((ns, name), asyncio.Lock())

    async def close(self) -> None:
        for task in (self.node_task, self.sweep_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.queue is not None:
            await self.queue.stop()
        await self.engines.aclose()
        if self.scraper:
            await self.scraper.aclose()
        if self.prometheus:
            await self.prometheus.aclose()
        if self.router:
            await self.router.aclose()
        await self.kube.close()
