"""Two readings of an operator under load, for bench/operator_scale.py: are rounds delivered when due, and
where a scale-up's reaction time goes.

Rounds delivered / rounds due (event-driven rounds: a fixed rounds-per-second rate no longer says whether
the operator keeps up). A round is *due* when its service's queued entry reaches its due time: an input
changed (its metrics moved in the shared sweep, a pod or ScalePlan of it changed, its spec changed; several
changes before the round starts are one due round) or its resync period (or a moving service's next
interval tick) expired. It is *delivered* when it starts within one metric interval of that due time. Over
the steady window: due = rounds started (the operator's `kascade_operator_round_lateness_seconds` count)
+ the queued rounds already more than one interval overdue at the end (`kascade_operator_rounds_overdue`);
delivered = the started ones whose lateness is <= one interval (the histogram's bucket at that bound).
An operator without these metrics (an older tree in `--compare`) gets NaN. The window starts once the operator
has settled (`settle`: the rounds a set-up queued are delivered).

The reaction's path, from the operator's `kascade_operator.trace` DEBUG lines (trace.py; the bench turns
them on with KASCADE_DEBUG_LOGGERS) and the stand-in's bind time, all on this host's monotonic clock:
crossing (the windowed metric crosses the bound) -> wake (the sweep saw the service's loads change) ->
start (its round begins) -> decided (decide() returned the scale-up) -> planned (ScalePlan built) -> plan
(created on the API server) -> instructed (targets told to bind; returns after the bind answered) and bind
(the stand-in received it).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import httpx

LATE = re.compile(
    r'^kascade_operator_round_lateness_seconds_(bucket|count)\{(?:kind="(\w+)",?)?(?:le="([^"]+)")?[^}]*'
    r"\} (\S+)$"
)
OVERDUE = re.compile(r"^kascade_operator_rounds_overdue (\S+)$")
TRACE = re.compile(r"trace (\w+) (\S+) (\d+\.\d+)")
STEPS = ("wake", "start", "decided", "planned", "plan", "instructed")
# the operator's /metrics at 10,000 nodes on a loaded machine took over 10 s to answer (a busy event loop)
METRICS_TIMEOUT_S = 60.0

Lateness = dict[str, dict[float, float]]  # kind -> bucket bound (inf: the count) -> rounds


def lateness(port: int) -> tuple[Lateness, float]:
    """The lateness histogram's cumulative buckets per kind, and the overdue gauge (NaN: not exported)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT_S).text
    out: Lateness = {}
    overdue = math.nan
    for line in text.splitlines():
        if m := LATE.match(line):
            what, kind, le, v = m.groups()
            if what == "bucket" and kind:
                out.setdefault(kind, {})[float(le)] = float(v)
        elif m := OVERDUE.match(line):
            overdue = float(m.group(1))
    return out, overdue


def delivered_of_due(before: Lateness, after: Lateness, overdue_end: float, interval: float) -> dict[str, float]:
    """Rounds due and delivered in time between two readings, all kinds and per kind (see the docstring)."""
    if not after or math.isnan(overdue_end):
        return {"rounds_due": math.nan, "rounds_delivered": math.nan, "rounds_delivered_of_due": math.nan}
    out: dict[str, float] = {}
    tot_due = tot_ok = 0.0
    for kind, buckets in after.items():
        b0 = before.get(kind, {})
        started = buckets.get(math.inf, 0.0) - b0.get(math.inf, 0.0)
        bound = min((le for le in buckets if le >= interval), default=math.inf)
        ok = buckets.get(bound, 0.0) - b0.get(bound, 0.0)
        out[f"rounds_{kind}_started"] = started
        out[f"rounds_{kind}_in_time"] = ok
        tot_due += started
        tot_ok += ok
    tot_due += overdue_end
    out.update(
        {
            "rounds_due": tot_due,
            "rounds_delivered": tot_ok,
            "rounds_overdue_at_end": overdue_end,
            "rounds_delivered_of_due": round(tot_ok / tot_due, 4) if tot_due else math.nan,
        }
    )
    return out


def settle(port: int, interval: float, limit_s: float = 180.0) -> float:
    """Seconds until the operator has delivered the rounds a set-up queued: over a span of two intervals no round
    started more than one interval late and none is overdue (NaN: not within `limit_s`, or an operator without the
    metrics). The steady window starts then: right after the set-up, the setup operator (no --compare) was still
    taking the change rounds its 200 creations had queued, each late by its own creating round (issue 33: 0.41
    delivered/due in a window that was no steady state)."""
    t0 = time.monotonic()
    before, _ = lateness(port)
    while time.monotonic() - t0 < limit_s:
        time.sleep(2 * interval)
        after, overdue = lateness(port)
        due = delivered_of_due(before, after, overdue, interval)
        if math.isnan(due["rounds_due"]):
            return math.nan
        if due["rounds_due"] == due["rounds_delivered"]:
            return time.monotonic() - t0
        before = after
    return math.nan


def path(log: Path, service: str, t_cross: float, t_bind: float) -> dict[str, float]:
    """Milliseconds from the crossing to each step of the service's scale-up (those the log shows)."""
    if not log.exists():
        return {}
    ev: dict[str, list[float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if (m := TRACE.search(line)) and m.group(2).endswith("/" + service):
            ev.setdefault(m.group(1), []).append(float(m.group(3)))
    decided = [t for t in ev.get("decided", []) if t_cross - 1.0 <= t <= t_bind]
    if not decided:
        return {}
    d = decided[0]
    out = {"decided": d}
    for step in ("wake", "start"):  # the last before the deciding round
        if before := [t for t in ev.get(step, []) if t <= d]:
            out[step] = before[-1]
    for step in ("planned", "plan", "instructed"):
        if after := [t for t in ev.get(step, []) if t >= d]:
            out[step] = after[0]
    return {k: round((out[k] - t_cross) * 1000, 1) for k in STEPS if k in out} | {
        "bind": round((t_bind - t_cross) * 1000, 1)
    }


def show(steps: dict[str, float]) -> str:
    """'wake +412 | start +3 | ...': each step's time after the previous one (ms)."""
    parts, prev = [], 0.0
    for k, v in sorted(steps.items(), key=lambda kv: kv[1]):
        parts.append(f"{k} +{v - prev:.0f}")
        prev = v
    return " | ".join(parts) or "(no trace lines)"
