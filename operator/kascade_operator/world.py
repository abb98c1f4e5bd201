"""What one reconcile round reads (`World`) and what it decided (`Decision`): the round's typed seam.

A round is observe -> decide -> act (docs/operator.md, "One round"):
- `observe.observe(rt, body, trigger)` makes every read of the round (the ModelService, its spec after its
  ModelServiceRoles, pool pods, ScalePlans, node facts, each role's engine metrics, the router's demand, the
  engines' host-copy answers, the claims other rounds hold) and freezes them in one `World`;
- `decision.decide(world)` is pure: the `Decision` (policy per role, reconcile actions, conversions, host-copy
  work, serving-gate writes, the status and ModelServiceRole statuses, plans to prune, the next-round clock);
- `actuator.act(rt, world, decision)` is the only step that writes (kube.py, the engine client, the
  operator's memory and metrics).
Both types are frozen; their mappings are the snapshot's, never written after observe returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kascade_operator.api import ModelServiceSpec
from kascade_operator.decide import RoleDecision
from kascade_operator.demand import Demand
from kascade_operator.fleetboard import FleetView, Post
from kascade_operator.pool import PodView
from kascade_operator.reconcile import Action, Result
from kascade_operator.recovery import HealthWork
from kascade_operator.roleobject import Resolution
from kascade_operator.settings import OperatorSettings
from kascade_operator.status import Blocker
from kascade_planner import policies as P
from kascade_planner.conversion import Conversions


@dataclass(frozen=True)
class RoleWorld:
    """One role as observed: its engines' metrics and the role's remembered clocks."""

    role: str
    snap: P.MetricsSnapshot  # empty (MetricsSnapshot(now)) when a set desired count turns the policy off
    below_since_s: float | None = None  # the scale-down delay's clock (policies.ScaleState)
    last_busy_s: float | None = None  # last time a request or token was seen (idle-to-zero clock)
    loads: Mapping[str, float] = field(default_factory=dict)  # instance -> requests in flight and queued


@dataclass(frozen=True)
class World:
    """Everything a round of one ModelService reads, read once, before anything is written."""

    body: Mapping[str, Any]  # the ModelService as the watch showed it (metadata, spec, status)
    trigger: str  # "timer" (queued round) or kopf's reason (create/update/resume)
    now: float  # time.monotonic() of the round
    now_iso: str  # the same instant as an RFC 3339 string (status times)
    settings: OperatorSettings
    spec: ModelServiceSpec | None  # None when `problems` (the spec is refused)
    problems: tuple[str, ...] = ()  # field errors naming the field; nothing past the spec was read
    invalid_reported: bool = False  # this generation's refusal was reported already (Event + status)
    role_sources: Mapping[str, str] = field(default_factory=dict)  # role -> where its set count comes from
    role_objects: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # this service's, by name
    resolution: Resolution = field(default_factory=lambda: Resolution({}, {}))
    pool_ns: str = ""
    key: str = ""  # the service key its pods carry (pool.service_key)
    # the pool as this round needs it: the service's pods, the idle ones, the pods keeping its model in host
    # memory (a draining pod is marked drained: its release is tried each round)
    pods: tuple[PodView, ...] = ()
    raw_pods: tuple[Mapping[str, Any], ...] = ()  # the same pods as the watch holds them (serving gates)
    plans: tuple[Mapping[str, Any], ...] = ()  # the service's ScalePlans
    held: frozenset[str] = frozenset()  # pods unfinished ScalePlans of any service hold (targets, host sources)
    reserved: frozenset[str] = frozenset()  # pool pods other rounds claimed for their plans (Runtime.reserve)
    expected: int = 0  # fallback pods created for the service that the watch does not show yet
    roles: tuple[RoleWorld, ...] = ()
    demand: Demand | None = None  # the router's demand for the service; None: none could be read
    router: bool = False  # a router is configured (settings.router_url)
    swept: bool = True  # metrics come from the shared sweep (else the round itself scraped or asked Prometheus)
    copy_checks: Mapping[str, int | None] = field(default_factory=dict)  # pod -> hostCopyBytes read now
    # the shared pool's arbitration (fleetboard.py; None: no board, a single-service pool) and, per arbitration
    # entry, the pods draining in the pool preempted for it (coming to it)
    fleet: FleetView | None = None
    promised: Mapping[str, int] = field(default_factory=dict)
    # the labels of the nodes the round's pods run on (node facts: GPU type and memory, the selector's keys);
    # the fleet's target choice reads them (fleettargets.py); a node missing here is not known to the operator
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # idle pods dropped as unhealthy (recovery.py): engine status read now (None: no answer), and the operator's
    # (next check, backoff) for those it knows
    health_checks: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    health_retry: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def generation(self) -> int | None:
        g = self.body["metadata"].get("generation")
        return int(g) if g is not None else None


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class CopyWork:
    """Host copies of the model this round (hostcopykeeper.py): records to clear, copies to drop, who to ask."""

    lost: tuple[str, ...] = ()  # pods whose engine answered hostCopyBytes 0: the record goes
    drop: tuple[str, ...] = ()  # serving pods whose copy is surplus (released pods keep enough)
    ask: str | None = None  # the serving pod asked to keep one


@dataclass(frozen=True)
class Decision:
    """What act() does for one round, and what it records."""

    status: Mapping[str, Any] | None  # the ModelService status to write; None: unchanged, no write
    events: tuple[Event, ...] = ()
    result: Result | None = None  # the reconciler's answer (None: the spec was refused)
    actions: tuple[Action, ...] = ()  # to carry out, in order (a refused CreatePods is left out)
    blocker: Blocker | None = None
    decisions: tuple[RoleDecision, ...] = ()  # every role's decision after the zero rule
    changes: tuple[RoleDecision, ...] = ()  # the roles whose count moves
    clocks: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)  # role -> (below, busy)
    conversions: Conversions | None = None  # convertible decoders (disaggregated)
    copies: CopyWork = field(default_factory=CopyWork)
    gates: tuple[tuple[str, bool], ...] = ()  # pool pods whose serving gate condition is written
    labels: tuple[tuple[str, bool], ...] = ()  # pool pods whose serving label is written
    role_statuses: tuple[tuple[str, Mapping[str, Any]], ...] = ()  # ModelServiceRole name -> status to write
    prune: tuple[str, ...] = ()  # finished ScalePlans beyond spec.scalePlanHistoryLimit
    interval: float = 1.0  # the service's round interval (spec.scaling.intervalSeconds)
    moving: tuple[str, ...] = ()  # why the next round comes one interval on (empty: steady, resync only)
    invalid_generation: int | None = None  # a refusal reported now: the generation it was reported for
    post: Post | None = None  # the ask this round leaves on its pool's fleet board (fleetboard.py)
    wake: tuple[str, ...] = ()  # service keys of donors preempted for this service: their rounds are due now
    health: HealthWork = field(default_factory=HealthWork)  # unhealthy pods to heal or check later (recovery.py)
