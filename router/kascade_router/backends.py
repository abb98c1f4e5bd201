"""Which pods may serve which model: the routing table, fed by watch events, read per request.

Data flow: ModelService and Pod dicts from the API watch (watch.py) -> `service_model()` /
`pod_backend()` (pure: a pod is a backend only while Ready, bound to a ModelService, loaded or live,
not draining, not marked unhealthy, with an address) -> `Routes` (model name -> its ModelService ->
its `Backend`s) -> the balancer picks one per request; `Routes.changed()` wakes requests held while a
model has no serving backend (scale from zero).

The label and annotation keys are the operator's binding record (kascade_operator.labels); they are
repeated here because the router imports nothing of the operator (a test keeps both equal).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kascade_router.firsttoken import FirstTokens

log = logging.getLogger(__name__)

MODEL_SERVICE = "kascade.io/model-service"
ENDPOINT = "kascade.io/endpoint"
LOADED = "kascade.io/loaded"
LIVE = "kascade.io/live"
DRAINING = "kascade.io/draining"
UNHEALTHY = "kascade.io/unhealthy"
ROLE = "kascade.io/role"  # label: prefill | decode | colocated (disaggregated serving)
CONVERTIBLE = "kascade.io/convertible"  # annotation "true": a decode engine that also takes prefill (TokenScale)
ACT_ENDPOINT = "kascade.io/act-endpoint"  # annotation: host:port of the engine's data port (PD: KV leaves there)
# A loading replica serving live runs only its resident prefix and hands the rest to its pair: its weight
# is the share of layers it runs, which the engine reports on every answer (SERVING_SHARE_HEADER). Until
# its first answer the router has no report: it starts at this prior.
LIVE_PRIOR_WEIGHT = 0.5
MIN_WEIGHT = 0.05  # a live replica with one layer of many still gets an occasional request (and reports again)
# The head of an execute-while-load pipeline of k receivers reports k: no source runs its layers, and k
# accelerators serve its requests (kascade_engine.instance.serving_share). A report above this is garbage.
MAX_WEIGHT = 64.0
# The operator's readiness gate on pool pods: True only while bound and loaded or live, not draining.
# Kubelets fold it into Ready; the router checks it too, so a stale Ready never routes to an idle pod.
SERVING_GATE = "kascade.io/serving"


@dataclass(frozen=True)
class PodRoute:
    service: tuple[str, str]  # (namespace, ModelService name)
    pod: str
    address: str  # host:port of the engine's HTTP server
    weight: float
    role: str = "colocated"
    data: str | None = None  # host:port of the engine's data port (a prefill engine's KV leaves there)
    convertible: bool = False  # a decode engine converted to take prefill too
    live: bool = False  # loading and serving live with its pair (weight from the engine's reports)


def service_model(msvc: Mapping[str, Any]) -> str | None:
    """The `model` name clients send for this ModelService (spec.model.name)."""
    name = ((msvc.get("spec") or {}).get("model") or {}).get("name")
    return str(name) if name else None


def _address(pod: Mapping[str, Any], ann: Mapping[str, str]) -> str | None:
    if ann.get(ENDPOINT):
        return ann[ENDPOINT]  # set by the local harness (engines on loopback) or by hand
    ip = (pod.get("status") or {}).get("podIP")
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and ip:
                return f"{ip}:{p['containerPort']}"
    return None


def _data_address(pod: Mapping[str, Any], ann: Mapping[str, str]) -> str | None:
    if ann.get(ACT_ENDPOINT):
        return ann[ACT_ENDPOINT]
    ip = (pod.get("status") or {}).get("podIP")
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "act" and ip:
                return f"{ip}:{p['containerPort']}"
    return None


def pod_backend(pod: Mapping[str, Any]) -> PodRoute | None:
    """The route to this pod if it can serve its model now, else None."""
    meta = pod.get("metadata") or {}
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    svc = labels.get(MODEL_SERVICE)
    if not svc or meta.get("deletionTimestamp") or DRAINING in ann or ann.get(UNHEALTHY):
        return None
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    if conds.get("Ready") != "True":
        return None  # the engine's /readyz (readinessProbe) says it cannot serve
    gates = {g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []}
    if SERVING_GATE in gates and conds.get(SERVING_GATE) != "True":
        return None  # the operator has not opened (or has closed) the pod's serving gate
    if ann.get(LOADED) == "true":
        live = False
    elif ann.get(LIVE) == "true":
        live = True
    else:
        return None  # bound but loading without a live pair
    addr = _address(pod, ann)
    if not addr:
        return None
    role = str(labels.get(ROLE) or "colocated")
    return PodRoute((str(meta.get("namespace", "")), svc), str(meta.get("name")), addr,
                    LIVE_PRIOR_WEIGHT if live else 1.0, role, _data_address(pod, ann),
                    ann.get(CONVERTIBLE) == "true", live)


@dataclass(eq=False)
class Backend:
    """One serving engine as the balancer sees it; `in_flight` is this router's outstanding requests."""
    pod: str
    address: str
    weight: float = 1.0
    role: str = "colocated"
    data: str | None = None
    convertible: bool = False
    in_flight: int = 0
    # requests this engine prefills now (until their first token): what a prefill candidate is ranked by,
    # since a converted decoder's in_flight also holds every stream it decodes
    prefilling: int = 0
    ejected_until: float = 0.0  # ejected (kascade_router.health): skip it until then (or until its pod changes)
    failures: int = 0  # connections to it that failed before an answer, in a row (health.Health)
    live: bool = False
    # a converted decoder's last reported prefill room (PREFILL_ROOM_HEADER): None while it reports none
    prefill_room: int | None = None
    # the prompt tokens/s the engine last reported it actually prefills (PREFILL_RATE_HEADER, on its answers and
    # /readyz): a converted decoder is weighed by its rate over a prefill engine's; None while it reports none
    prefill_rate: float | None = None
    # this router's requests' first tokens there: rate and latency, for routing on expected TTFT (firsttoken.py)
    first_tokens: FirstTokens = field(default_factory=FirstTokens)

    def reported_rate(self, rate: str | None) -> None:
        """The engine's prefill rate from an answer or /readyz; no header (not measured, or the budgets it was
        measured under changed) clears it, garbage (not a number, negative, infinite) is ignored."""
        if rate is None:
            self.prefill_rate = None
            return
        try:
            v = float(rate)
        except ValueError:
            return
        if 0 <= v < float("inf"):
            self.prefill_rate = v

    def reported_room(self, room: str | None) -> None:
        """The engine's prefill room from its answer; no header (not converted) clears it, garbage is ignored."""
        if room is None:
            self.prefill_room = None
            return
        try:
            v = int(room)
        except ValueError:
            return
        if v >= 0:
            self.prefill_room = v

    def usable(self, now: float) -> bool:
        return self.ejected_until <= now

    def reported(self, share: str | None) -> None:
        """The engine's own serving share (its answer's SERVING_SHARE_HEADER) becomes a live replica's
        weight (`live_weight`). A complete copy keeps 1."""
        if self.live:
            self.weight = live_weight(share, self.weight)


def live_weight(share: str | None, weight: float) -> float:
    """A live replica's weight after its engine reported `share`: its resident share when live with a source,
    the capacity of the pipeline it heads (> 1). A share of 0 (no layer landed yet when it answered) keeps the
    weight it had: the share of a loading replica only grows, and it is refreshed only by the replica's own
    answers, so a 0 at MIN_WEIGHT starved it for the rest of its load (bench/live.py: a B whose first request
    came before its first layer got no other until it was complete, then a queue of 2-3 s). Garbage (not a
    number, negative, above MAX_WEIGHT) keeps it too."""
    try:
        v = float(share) if share is not None else float("nan")
    except ValueError:
        return weight
    if 0.0 < v <= MAX_WEIGHT:
        return max(MIN_WEIGHT, v)
    return weight


@dataclass
class Routes:
    """model name -> ModelService -> backends; mutated only by watch events, read by every request."""
    models: dict[str, tuple[str, str]] = field(default_factory=dict)
    backends: dict[tuple[str, str], dict[str, Backend]] = field(default_factory=dict)
    _service_models: dict[tuple[str, str], str] = field(default_factory=dict)
    _pod_services: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    _changed: asyncio.Event | None = None

    def set_service(self, ns: str, name: str, model: str | None) -> None:
        key = (ns, name)
        old = self._service_models.pop(key, None)
        if old is not None and self.models.get(old) == key:
            del self.models[old]
        if model is None:
            return
        taken = self.models.get(model)
        if taken is not None and taken != key:
            log.warning("model %r is served by ModelService %s/%s already; %s/%s ignored",
                        model, *taken, ns, name)
            return
        self._service_models[key] = model
        self.models[model] = key
        self._notify()

    def remove_service(self, ns: str, name: str) -> None:
        self.set_service(ns, name, None)

    def set_pod(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        pkey = (str(meta.get("namespace", "")), str(meta.get("name")))
        route = pod_backend(pod)
        old_svc = self._pod_services.pop(pkey, None)
        if route is None:
            if old_svc is not None:
                self.backends.get(old_svc, {}).pop(pkey[1], None)
            return
        if old_svc is not None and old_svc != route.service:
            self.backends.get(old_svc, {}).pop(pkey[1], None)
        self._pod_services[pkey] = route.service
        mine = self.backends.setdefault(route.service, {})
        b = mine.get(route.pod)
        if b is None or b.address != route.address:
            mine[route.pod] = Backend(route.pod, route.address, route.weight, route.role, route.data,
                                      route.convertible, live=route.live)
        else:  # the pod changed: give it another chance
            if not (b.live and route.live):  # still live: keep the weight its engine reported
                b.weight = route.weight
            b.ejected_until, b.role, b.data, b.live = 0.0, route.role, route.data, route.live
            b.convertible = route.convertible
        self._notify()

    def remove_pod(self, ns: str, name: str) -> None:
        svc = self._pod_services.pop((ns, name), None)
        if svc is not None:
            self.backends.get(svc, {}).pop(name, None)

    def pod_keys(self) -> list[tuple[str, str]]:
        return list(self._pod_services)

    def lookup(self, model: str) -> tuple[str, str] | None:
        return self.models.get(model)

    def serving(self, svc: tuple[str, str], now: float | None = None) -> list[Backend]:
        t = time.monotonic() if now is None else now
        return [b for b in self.backends.get(svc, {}).values() if b.usable(t)]

    def wake(self) -> None:
        """Wake held requests: a backend came back or freed a connection slot."""
        self._notify()

    def changed(self) -> asyncio.Event:
        """An event set at the next change of the table (held requests wait on it)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        ev, self._changed = self._changed, None
        if ev is not None:
            ev.set()
