"""The demo's record, PURE: what the cluster looked like over time and what happened, turned into the
lines the terminal shows and the plot the demo saves.

Data flow: observations (ModelService status, ScalePlans, bound pods, request results) -> `Timeline.
observe()` compares them with the previous observation and appends `Event`s (a decision, a plan with
its chains, weights flowing, a target ready or live, a release) and one `Sample` per observation ->
`plot()` draws replicas, load and TTFT over time with the events marked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the demo started
    ready: int
    loading: int
    live: int
    requests_per_s: float
    tokens_per_s: float
    ttft_ms: float | None  # median of the requests finished since the previous sample


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # decision | plan | flow | ready | live | release | done | load
    text: str


@dataclass
class Timeline:
    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    _decision: str = ""
    _plans: dict[str, str] = field(default_factory=dict)  # ScalePlan name -> last phase seen
    _progress: dict[str, str] = field(default_factory=dict)
    _ready: set[str] = field(default_factory=set)
    _live: set[str] = field(default_factory=set)

    def add(self, t: float, kind: str, text: str) -> Event:
        ev = Event(t, kind, text)
        self.events.append(ev)
        return ev

    def observe(self, t: float, msvc: Mapping[str, Any], plans: Sequence[Mapping[str, Any]],
                pods: Sequence[Mapping[str, Any]], leaf_of: Mapping[str, str], sample: Sample) -> list[Event]:
        """Record one observation; returns the events it revealed, in order."""
        out: list[Event] = []
        d = (msvc.get("status") or {}).get("lastDecision") or {}
        key = f"{d.get('time')}|{d.get('to')}"
        if d and key != self._decision:
            self._decision = key
            nums = ", ".join(f"{k}={v:.0f}" for k, v in (d.get("metrics") or {}).items())
            out.append(
                self.add(
                    t,
                    "decision",
                    f"decision: {d.get('from')} -> {d.get('to')} replicas ({d.get('reason')})"
                    + (f" [{nums}]" if nums else ""),
                )
            )
        for p in sorted(plans, key=lambda p: p["metadata"]["creationTimestamp"] + p["metadata"]["name"]):
            name, spec, st = p["metadata"]["name"], p["spec"], p.get("status") or {}
            phase = st.get("phase") or "Pending"
            if name not in self._plans:
                out.append(self.add(t, "plan", describe_plan(name, spec, leaf_of)))
            if self._plans.get(name) != phase:
                self._plans[name] = phase
                if phase in ("Succeeded", "Failed"):
                    extra = f", {st['bandwidthGbps']:.2f} Gbit/s" if st.get("bandwidthGbps") else ""
                    out.append(
                        self.add(
                            t,
                            "done",
                            f"ScalePlan {name} {phase} in {st.get('durationSeconds', 0):.1f} s "
                            f"({st.get('targetsReady', '?')} targets{extra}) {st.get('message', '')}".rstrip(),
                        )
                    )
            prog = st.get("progress")
            if prog and phase not in ("Succeeded", "Failed") and self._progress.get(name) != prog:
                self._progress[name] = prog
                rows = ", ".join(f"{r['instance']} {r.get('blocksReceived', 0)}/{r.get('blocksTotal', 0)}"
                                 for r in st.get("targets") or [])
                out.append(self.add(t, "flow", f"weights flowing ({name}): {rows}"))
        for pod in pods:
            name, ann = pod["metadata"]["name"], pod["metadata"].get("annotations") or {}
            if ann.get("kascade.io/live") == "true" and name not in self._live:
                self._live.add(name)
                out.append(self.add(t, "live", f"{name} serves live while loading (its resident layers here, the "
                                               f"rest on its pair)"))
            if ann.get("kascade.io/loaded") == "true" and name not in self._ready:
                self._ready.add(name)
                out.append(self.add(t, "ready", f"{name} ready on {pod['spec'].get('nodeName')}"))
        bound = {p["metadata"]["name"] for p in pods}
        for name in sorted(self._ready - bound):
            self._ready.discard(name)
            self._live.discard(name)
            out.append(self.add(t, "release", f"{name} drained and returned to the warm pool"))
        self.samples.append(sample)
        return out


def describe_plan(name: str, spec: Mapping[str, Any], leaf_of: Mapping[str, str]) -> str:
    """'ScalePlan x (chain): engine-0[leaf-0] -> engine-2[leaf-0] -> engine-1[leaf-1]; live: ...'."""
    node = {**{s["instance"]: s.get("node", "") for s in spec.get("sources") or []},
            **{t["instance"]: t.get("node", "") for t in spec.get("targets") or []}}

    def hop(i: str) -> str:
        return f"{i}[{leaf_of.get(node.get(i, ''), '?')}]"

    if spec.get("algorithm") == "local":
        where = ", ".join(hop(t["instance"]) for t in spec.get("targets") or [])
        return f"ScalePlan {name} (local): first copy from {spec['sources'][0].get('path', 'disk')} into {where}"
    chains = "; ".join(" -> ".join(hop(i) for i in c) for c in spec.get("chains") or [])
    live = ", ".join(f"{p['loading']} with {p['overloaded']}" for p in spec.get("livePairs") or [])
    sec = spec.get("predictedSeconds")
    pred = "" if not sec else f", predicted {_duration(sec)} at the links' rates"
    return f"ScalePlan {name} ({spec.get('algorithm')}{pred}): {chains}" + (f"; live: {live}" if live else "")


def _duration(sec: float) -> str:
    """'1.25 s', '38 ms', '0.41 ms', '3 us': a tiny model's plan predicts well under a millisecond (the demo's printed
    '0 ms' before)."""
    if sec >= 1:
        return f"{sec:.2f} s"
    if sec >= 0.01:
        return f"{sec * 1e3:.0f} ms"
    if sec >= 1e-4:
        return f"{sec * 1e3:.2f} ms"
    return f"{sec * 1e6:.0f} us"


def plot(tl: Timeline, path: Path, title: str = "Kascade demo") -> Path:
    """Replicas (ready, loading, live), load and TTFT over time, with scale events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = tl.samples
    t = [x.t for x in s]
    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ax[0].step(t, [x.ready for x in s], where="post", label="ready replicas", color="tab:green")
    ax[0].step(t, [x.loading for x in s], where="post", label="loading", color="tab:orange")
    ax[0].step(t, [x.live for x in s], where="post", label="serving live while loading", color="tab:purple",
               linestyle="--")
    ax[0].set_ylabel("replicas")
    ax[1].plot(t, [x.tokens_per_s for x in s], color="tab:blue")
    ax[1].set_ylabel("tokens/s served")
    pts = [(x.t, x.ttft_ms) for x in s if x.ttft_ms is not None]
    ax[2].plot([p[0] for p in pts], [p[1] for p in pts], ".", color="tab:red")
    ax[2].set_ylabel("TTFT median (ms)")
    ax[2].set_xlabel("seconds")
    loads = [e for e in tl.events if e.kind == "load"]  # "burst ..." then "calm ...": shade the burst
    for start, end in zip(loads, [*loads[1:], None], strict=False):
        if start.text.startswith("burst"):
            for a in ax:
                a.axvspan(start.t, end.t if end else (t[-1] if t else start.t), color="tab:red", alpha=0.06)
    colors = {"decision": "black", "plan": "tab:blue", "done": "tab:green", "release": "tab:gray"}
    for ev in tl.events:
        if ev.kind in colors:
            for a in ax:
                a.axvline(ev.t, color=colors[ev.kind], alpha=0.3, linewidth=1)
    ax[0].legend(loc="upper left")
    ax[0].set_title(f"{title} (shaded: burst; lines: decisions black, plans blue, plans done green, releases gray)",
                    fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
