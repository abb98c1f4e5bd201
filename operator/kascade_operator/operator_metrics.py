"""The operator's own Prometheus metrics (prometheus-client, one registry per operator instance).

Data flow: handlers observe durations and counts here -> `/metrics` on `settings.metrics_port`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.reconcile = Histogram("kascade_operator_reconcile_seconds", "ModelService reconcile latency",
                                   ["trigger"], registry=r, buckets=_FAST)
        self.sweep = Histogram("kascade_operator_metric_sweep_seconds", "One scrape of every serving engine "
                               "(the shared metric sweep)", registry=r, buckets=_FAST)
        self.plan_generation = Histogram("kascade_operator_plan_generation_seconds", "Planner time per ScalePlan",
                                         registry=r, buckets=_FAST)
        # per ModelService and role, like the replicas gauge (the dashboard is per model)
        self.decisions = Counter("kascade_operator_decisions", "Scale decisions",
                                 ["namespace", "model_service", "role", "policy", "direction"], registry=r)
        self.plan_duration = Histogram("kascade_operator_plan_duration_seconds", "ScalePlan start to finish",
                                       ["namespace", "model_service", "phase"], registry=r,
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.pool_size = Gauge("kascade_operator_pool_idle_pods", "Idle warm-pool pods", ["namespace"], registry=r)
        self.instruct = Histogram("kascade_operator_reaction_seconds", "Decision to all targets instructed",
                                  registry=r, buckets=_FAST)
        # per ModelService, set every reconcile (the dashboard's replicas panel, the scale-up-stuck alert)
        self.replicas = Gauge("kascade_operator_replicas", "Replicas of a ModelService role by state "
                              "(desired, ready, loading)", ["namespace", "model_service", "role", "state"], registry=r)
        self.plans_active = Gauge("kascade_operator_scaleplans_active", "Unfinished ScalePlans of a ModelService",
                                  ["namespace", "model_service"], registry=r)
        self.plan_age = Gauge("kascade_operator_scaleplan_oldest_active_seconds",
                              "Age of a ModelService's oldest unfinished ScalePlan (0: none)",
                              ["namespace", "model_service"], registry=r)

        # rounds due vs delivered (bench/operator_scale.py): a round is due when its service's queued entry
        # reaches its due time (an input change, or a resync / moving tick expiring); its lateness = start - due
        self.queue_wait = Histogram("kascade_operator_round_lateness_seconds", "Start of a queued round minus "
                                    "the time it was due, by why it was queued (change: an input changed; "
                                    "resync: the resync period or a moving service's next tick)", ["kind"],
                                    registry=r, buckets=_FAST)
        self.overdue = Gauge("kascade_operator_rounds_overdue", "Queued rounds already more than one interval "
                             "past their due time (due, not delivered)", registry=r)

    def watch_queue(self, overdue: Callable[[], float]) -> None:
        """The overdue gauge reads the work queue at scrape time."""
        self.overdue.set_function(overdue)

    def observe_service(self, namespace: str, service: str, roles: Mapping[str, Any],
                        active_plan_ages_s: Iterable[float]) -> None:
        """Record one reconcile's view: `roles` maps role -> object with desired/ready/loading counts."""
        for role, r in roles.items():
            for state in ("desired", "ready", "loading"):
                self.replicas.labels(namespace, service, role, state).set(getattr(r, state))
        for phase in ("Succeeded", "Failed"):
            # the series exist (at 0) before the first plan ends, so rate() sees its 0 -> 1 step: a series
            # born at 1 gives rate 0 and a NaN quantile on the dashboard until the next plan
            self.plan_duration.labels(namespace, service, phase)
        ages = list(active_plan_ages_s)
        self.plans_active.labels(namespace, service).set(len(ages))
        self.plan_age.labels(namespace, service).set(max(ages, default=0.0))

    def serve(self, port: int) -> None:
        start_http_server(port, addr="0.0.0.0", registry=self.registry)
