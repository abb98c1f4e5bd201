"""Live cooperative execution between an overloaded source S (all L layers) and a loading target T
(layer l becomes runnable at l·load_ratio), as pure simulations (BlitzScale §5.2).

Data flow: `PairSetting` -> a scheduler -> `Schedule` (per-batch finish times). A batch runs its first
layers on T and the rest on S (activations move once, T -> S). Schedulers:
- `stop_the_world`: S alone; T serves whole batches only once fully loaded.
- `best_effort`: T takes one fresh batch at a time, runs whatever is loaded, hands it to S when stuck.
- `ilp_free` (ZigZag without a solver): T keeps every batch in a priority queue (next layer loaded first,
  then FCFS) and advances them layer by layer (zig); S pulls only when idle, taking the batch closest
  to done (zag).
- `zigzag_ilp`: prefix lengths T_i (S_i = L - T_i) from the pipeline-configuration ILP (scipy `milp`,
  see `ilp_config`), then executed by the same simulator.
Time unit: one layer computation of one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairSetting:
    layers: int
    load_ratio: float  # time to load one layer, in layer computations
    batches: int
    migrate: float = 0.0  # moving activations T -> S
    # time since T's load began, in layer computations: a plan made mid-load (an engine re-planning from
    # the queue it has now) sees layer l runnable at (l+1)·load_ratio - elapsed, the landed ones at once
    elapsed: float = 0.0

    def __post_init__(self) -> None:
        if self.layers < 1 or self.batches < 1 or self.load_ratio < 0 or self.migrate < 0 or self.elapsed < 0:
            raise ValueError(f"invalid PairSetting {self}")

    def loaded_at(self, layer: int) -> float:
        """Time layer `layer` (0-based) becomes runnable on T, from now (the plan's t = 0)."""
        return max(0.0, (layer + 1) * self.load_ratio - self.elapsed)


@dataclass(frozen=True)
class Schedule:
    name: str
    finish: tuple[float, ...]
    target_layers: tuple[int, ...]  # layers of each batch executed on T

    @property
    def last(self) -> float:
        return max(self.finish)

    @property
    def average(self) -> float:
        return sum(self.finish) / len(self.finish)


@dataclass
class _State:
    done: list[int]  # layers completed per batch
    on_t: list[int]  # layers executed on T per batch
    owner: list[str]  # "" (unclaimed), "T", "S"
    ready: list[float]  # earliest start of the batch's next layer
    last: list[str]  # executor of the batch's previous layer
    busy: dict[str, tuple[int, float] | None]


Picker = Callable[[PairSetting, _State, float], int | None]


def _simulate(name: str, s: PairSetting, pick_t: Picker, pick_s: Picker) -> Schedule:
    n, L = s.batches, s.layers
    st = _State([0] * n, [0] * n, [""] * n, [0.0] * n, [""] * n, {"T": None, "S": None})
    finish = [math.inf] * n
    t = 0.0
    for _ in range(4 * n * L + 4 * L + 16):
        for ex in ("T", "S"):
            run = st.busy[ex]
            if run is not None and run[1] <= t + 1e-9:
                b = run[0]
                st.done[b] += 1
                st.on_t[b] += ex == "T"
                st.ready[b], st.last[b] = run[1], ex
                st.busy[ex] = None
                if st.done[b] == L:
                    finish[b] = run[1]
        if all(f < math.inf for f in finish):
            return Schedule(name, tuple(finish), tuple(st.on_t))
        for ex, pick in (("T", pick_t), ("S", pick_s)):
            if st.busy[ex] is None:
                pick_b = pick(s, st, t)
                if pick_b is not None:
                    b = pick_b
                    start = max(t, st.ready[b] + (s.migrate if st.last[b] not in ("", ex) else 0.0))
                    if start <= t + 1e-9:
                        st.owner[b] = ex
                        st.busy[ex] = (b, t + 1.0)
        events = [r[1] for r in st.busy.values() if r is not None]
        events += [s.loaded_at(layer) for layer in range(L) if s.loaded_at(layer) > t + 1e-9]
        events += [r + s.migrate for r in st.ready if r + s.migrate > t + 1e-9]
        t = min(events) if events else t + 1.0
    raise RuntimeError(f"{name}: simulation did not finish")


def _running(st: _State) -> set[int]:
    return {r[0] for r in st.busy.values() if r is not None}


def _open(s: PairSetting, st: _State) -> list[int]:
    return [b for b in range(s.batches) if st.done[b] < s.layers and b not in _running(st)]


def _t_can_run(s: PairSetting, st: _State, b: int, t: float) -> bool:
    return st.owner[b] != "S" and s.loaded_at(st.done[b]) <= t + 1e-9


def stop_the_world(s: PairSetting) -> Schedule:
    def pick_t(s: PairSetting, st: _State, t: float) -> int | None:
        if s.loaded_at(s.layers - 1) > t + 1e-9:
            return None
        mine = [b for b in _open(s, st) if st.owner[b] == "T"]
        fresh = [b for b in _open(s, st) if st.owner[b] == "" and st.done[b] == 0]
        choice = mine or fresh
        return choice[0] if choice else None

    def pick_s(s: PairSetting, st: _State, t: float) -> int | None:
        return next((b for b in _open(s, st) if st.owner[b] in ("", "S")), None)

    return _simulate("stop-the-world", s, pick_t, pick_s)


def best_effort(s: PairSetting) -> Schedule:
    def pick_t(s: PairSetting, st: _State, t: float) -> int | None:
        for b in _open(s, st):
            if st.owner[b] == "T":
                if _t_can_run(s, st, b, t):
                    return b
                st.owner[b] = ""  # stuck on an unloaded layer: hand it to S
        fresh = [b for b in _open(s, st) if st.owner[b] == "" and st.done[b] == 0 and _t_can_run(s, st, b, t)]
        return fresh[0] if fresh else None

    def pick_s(s: PairSetting, st: _State, t: float) -> int | None:
        return next((b for b in _open(s, st) if st.owner[b] in ("", "S")), None)

    return _simulate("best-effort", s, pick_t, pick_s)


def ilp_free(s: PairSetting) -> Schedule:
    def pick_t(s: PairSetting, st: _State, t: float) -> int | None:
        runnable = [b for b in _open(s, st) if _t_can_run(s, st, b, t)]
        return runnable[0] if runnable else None  # FCFS among batches whose next layer is loaded

    def pick_s(s: PairSetting, st: _State, t: float) -> int | None:
        mine = [b for b in _open(s, st) if st.owner[b] == "S"]
        if mine:
            return mine[0]
        waiting = _open(s, st)
        return max(waiting, key=lambda b: (st.done[b], -b)) if waiting else None

    return _simulate("zigzag-ilp-free", s, pick_t, pick_s)


def config_cost(s: PairSetting, prefix: tuple[int, ...]) -> float:
    """Objective of the pipeline-configuration ILP (Σ_i C_i) for integral prefixes: the tightest F, C."""
    f = c = total = 0.0
    for t in prefix:
        f = max(f + t, s.loaded_at(t - 1) if t else 0.0)
        c = max(c + s.layers - t, f + s.migrate + s.layers - t)
        total += c
    return total


def ilp_config(s: PairSetting, gap: float = 0.01) -> tuple[int, ...]:
    """Prefix lengths T_i of the pipeline configuration, by MILP.

    Variables per batch i: T_i (integer layers on T), F_i (T finishes the prefix), C_i (the batch
    completes). T runs prefixes in batch order and a prefix cannot end before its last layer is loaded;
    S runs the suffixes S_i = L - T_i in batch order, each after its prefix arrived:
        F_i >= F_{i-1} + T_i,   F_i >= load·T_i - elapsed,
        C_i >= C_{i-1} + L - T_i,   C_i >= F_i + migrate + L - T_i.
    Minimise Σ_i C_i: the paper's Σ_req Σ_{i<=req} S_i when S never idles, but also charging batches
    that wait for T. The LP relaxation is solved first. Any integral T is feasible (F and C only grow),
    so rounding the relaxed T gives an incumbent and the LP optimum a lower bound: when they are
    within `gap` (relative) the incumbent is returned, as HiGHS would with `mip_rel_gap=gap` — but
    without its branch-and-bound setup, which alone costs ~20 ms on a small machine. Otherwise (and
    always with gap=0) HiGHS branch-and-bound solves the ILP to `gap`.
    """
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    # imported here: scipy.optimize costs seconds of start-up on a loaded machine, and only the ILP needs it
    from scipy.optimize import Bounds, LinearConstraint, milp
    n, L, D = s.batches, s.layers, s.load_ratio
    nv = 3 * n
    cost = np.concatenate([np.zeros(2 * n), np.ones(n)])
    rows: list[np.ndarray] = []
    lo: list[float] = []

    def ge(coefs: dict[int, float], bound: float) -> None:
        row = np.zeros(nv)
        for k, v in coefs.items():
            row[k] += v
        rows.append(row)
        lo.append(bound)

    for i in range(n):  # T_i = i, F_i = n + i, C_i = 2n + i
        ge({n + i: 1, i: -1, **({n + i - 1: -1} if i else {})}, 0.0)
        ge({n + i: 1, i: -D}, -s.elapsed)
        ge({2 * n + i: 1, i: 1, **({2 * n + i - 1: -1} if i else {})}, float(L))
        ge({2 * n + i: 1, n + i: -1, i: 1}, L + s.migrate)
    upper = D * L + (n + 1) * (L + s.migrate)
    constraints = LinearConstraint(np.array(rows), np.array(lo), np.full(len(rows), np.inf))
    bounds = Bounds(np.zeros(nv), np.concatenate([np.full(n, L), np.full(2 * n, upper)]))
    res = milp(cost, constraints=constraints, bounds=bounds, integrality=np.zeros(nv))
    if not res.success:
        raise RuntimeError(f"ZigZag LP relaxation failed: {res.message}")
    relaxed = res.x[:n]
    candidates = [tuple(int(v) for v in np.clip(np.round(relaxed), 0, L)),
                  tuple(int(v) for v in np.clip(np.floor(relaxed + 1e-9), 0, L))]
    best = min(candidates, key=lambda p: (config_cost(s, p), p))
    if config_cost(s, best) <= float(res.fun) * (1 + gap) + 1e-9:
        return best
    res = milp(cost, constraints=constraints, bounds=bounds, options={"mip_rel_gap": gap},
               integrality=np.concatenate([np.ones(n), np.zeros(2 * n)]))
    if not res.success:
        raise RuntimeError(f"ZigZag ILP failed: {res.message}")
    return tuple(round(float(v)) for v in res.x[:n])


def run_config(s: PairSetting, prefix: tuple[int, ...], name: str = "zigzag-ilp") -> Schedule:
    """Execute a static configuration: T runs batch i's first prefix[i] layers (priority: loaded, FCFS);
    S runs the rest of each batch in batch order."""
    if len(prefix) != s.batches or any(not 0 <= p <= s.layers for p in prefix):
        raise ValueError(f"prefix must give 0..{s.layers} layers for each of {s.batches} batches: {prefix}")

    def pick_t(s: PairSetting, st: _State, t: float) -> int | None:
        runnable = [b for b in _open(s, st) if st.on_t[b] < prefix[b] and _t_can_run(s, st, b, t)]
        return runnable[0] if runnable else None

    def pick_s(s: PairSetting, st: _State, t: float) -> int | None:
        for b in range(s.batches):
            if st.done[b] < s.layers:
                ok = st.on_t[b] >= prefix[b] and b not in _running(st)
                return b if ok else None  # strictly in batch order
        return None

    return _simulate(name, s, pick_t, pick_s)


def zigzag_ilp(s: PairSetting) -> Schedule:
    return run_config(s, ilp_config(s))
