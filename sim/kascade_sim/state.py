"""The simulator's shared state, declared once for the type checker.

`simulator.Simulation` owns and sets every attribute here (in `__init__` and `run`); the mixins
(`scaling.Scaling`, `serving.Serving`, `autoscaler.Autoscaler`) and `pdpolicy` read and update them.
`SimState` is their common base: it only annotates (no values, no `__init__`), so at run time it adds
nothing to the class. The methods one mixin calls on another are declared under `TYPE_CHECKING`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kascade_planner.pdratio import PdVelocity
from kascade_planner.plan import ModelLayout
from kascade_planner.policies import MetricsSnapshot, ScaleState, Threshold
from kascade_planner.topology import Topology
from kascade_sim.config import SimConfig
from kascade_sim.hardware import Hardware, ModelSpec
from kascade_sim.hostmem import HostMemory
from kascade_sim.instance import Instance
from kascade_sim.result import ScaleEvent
from kascade_sim.systems import System
from kascade_sim.workload import Workload

__all__ = ["SimState"]

Group = tuple[int, str]  # (model, role)


class SimState:
    # inputs and what is derived from them once
    wl: Workload
    hw: Hardware
    spec: ModelSpec
    sys: System
    cfg: SimConfig
    progress: Callable[[float], None] | None
    topo: Topology
    layout: ModelLayout
    kv_cap: int
    _prefill_s: Callable[[int], float]
    _decode_s: Callable[[int, int], float]
    models: int
    roles: tuple[str, ...]
    max_instances: int
    kv_bytes_per_s: float
    # per request (index r)
    arr: list[float]
    inp: list[int]
    out: list[int]
    mdl: list[int]
    clipped: int
    first: list[float]
    last: list[float]
    unfinished: int
    served_by: list[str]
    holder: dict[int, Instance]
    handed: set[int]
    # live pairs and conversions
    pairings: list[tuple[float, str, str, float]]
    max_debt_s: float
    converted_prefills: int
    policy_calls: list[tuple[float, str, object, object]]
    chunk_tokens: dict[int, int]
    hand_back_s: dict[int, float | None]  # None: no TTFT SLO, no hand-back
    prefill_took: dict[int, float]
    pd_velocity: dict[int, PdVelocity]
    finished: dict[int, list[tuple[float, float, float]]]
    # event loop
    heap: list[tuple[float, int, int, object]]
    seq: int
    _now: float
    # cluster and instances
    free: dict[str, int]
    instances: list[Instance]
    gpus_allocated: int
    next_id: int
    events: list[ScaleEvent]
    samples: list[tuple[float, int, int, float]]
    queue: dict[Group, deque[int]]
    group: dict[Group, list[Instance]]
    states: dict[Group, ScaleState]
    history: dict[Group, deque[float]]
    busy_time: dict[Group, float]
    busy_seen: dict[Group, float]
    demand: dict[Group, list[float]]
    rps: dict[int, list[float]]
    _zigzag: dict[tuple[float, int], float]
    _load_s: dict[int, float]
    hostmem: HostMemory
    cache_peak: int
    loads: int
    arbitrated: bool  # the planner's arbitration decides across models (arbiter.Arbiter)

    if TYPE_CHECKING:  # defined by one mixin, called by another
        def push(self, t: float, kind: int, obj: object) -> None: ...
        def _policy(self, role: str) -> Threshold: ...
        def _free_slots(self) -> int: ...
        def _load_estimate(self, m: int) -> float: ...
        def _host_copies(self, now: float) -> int: ...
        def _scale_up(self, now: float, m: int, role: str, count: int, reason: str) -> None: ...
        def _scale_down(self, now: float, m: int, role: str, count: int, reason: str) -> None: ...
        def _maybe_release(self, inst: Instance, now: float) -> None: ...
        def _wake(self, m: int, role: str, now: float) -> None: ...
        def _side_rate(self, inst: Instance) -> float: ...
        def _new_prefiller_s(self, m: int, r: int) -> float | None: ...
        def _remote_s(self, m: int, r: int) -> float | None: ...
        def _kick(self, inst: Instance, now: float) -> None: ...
        def _arbitrated_tick(self, now: float, k: int) -> None: ...
        def _instances_for(self, m: int, role: str) -> int: ...
        def _metric(self, m: int, role: str, k: int) -> MetricsSnapshot: ...
