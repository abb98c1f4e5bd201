"""Per-request TTFT breakdown of a `bench/live.py --real-only` run kept with KASCADE_BENCH_ENGINE_LOGS=dir:
joins the driver's requests (`<tag>-<mode>-requests.json`: id, arrival, TTFT, engine) with the engines'
timelines (`<tag>-<engine>.log`, kascade_engine.batch.timeline lines) and splits each request's TTFT into
where it waited.

Phases (seconds, per request; missing events leave a phase out):
  to_engine   sent by the driver -> `submit` on the engine it was routed to
  A: queue    submit -> `a-start` (first scheduled on the source), then first token (the rest of the TTFT)
  redirected  submit on A -> `a-redirect` (handed to the pair) -> `b-took` -> `b-start` -> `b-sent` -> `b-token`
  B: hold     `b-plan` -> `b-release` (ZigZag held it for its prefix); queue: submit/release -> `b-start`;
     prefix   `b-start` -> `b-sent` (its first step's prefix on B); pair: `b-sent` -> `b-token` (A's boundary
              wait + A's step + the answer)
Usage: python bench/livebreakdown.py DIR [TAG]  (TAG: k17a, k17p2, k17p4; default all)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"kascade_engine\.timeline: t=(\S+) (\S+) (\S+)")


def events(logdir: Path, tag: str) -> dict[str, dict[str, float]]:
    """request id -> event -> unix time (first occurrence), over every engine of the lab."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for f in logdir.glob(f"{tag}-*.log"):
        for line in f.read_text(errors="replace").splitlines():
            m = LINE.search(line)
            if m and m.group(3) != "-":
                out[m.group(3)].setdefault(m.group(2), float(m.group(1)))
    return out


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def report(logdir: Path, tag: str) -> None:
    ev = events(logdir, tag)
    for f in sorted(logdir.glob(f"{tag}-*-requests.json")):
        mode = f.name[len(tag) + 1:-len("-requests.json")]
        d = json.loads(f.read_text())
        rows = d["rows"]
        groups: dict[str, list[dict[str, float]]] = defaultdict(list)
        for i, at, ttft, eng, rid, sent in rows:
            e = ev.get(rid, {})
            if ttft != ttft:  # NaN: failed
                continue
            ph: dict[str, float] = {"ttft": ttft, "i": i, "at": at}
            if "submit" in e:
                ph["to_engine"] = e["submit"] - sent
            if "a-redirect" in e:
                kind = "redirected"
                ph["A_queue"] = e["a-redirect"] - e["submit"]
                if "b-took" in e:
                    ph["handover"] = e["b-took"] - e["a-redirect"]
                    if "b-start" in e:
                        ph["B_queue"] = e["b-start"] - e["b-took"]
            elif "b-plan" in e or "b-start" in e:
                kind = "on B"
                ready = e.get("b-release", e.get("b-plan", e.get("submit", 0.0)))
                if "b-release" in e:
                    ph["hold"] = e["b-release"] - e["b-plan"]
                if "b-start" in e:
                    ph["B_queue"] = e["b-start"] - ready
            elif "a-start" in e:
                kind = "on A"
                ph["A_queue"] = e["a-start"] - e["submit"]
                ph["A_step"] = sent + ttft - e["a-start"]
            else:
                kind = f"no timeline ({eng})"
            if "b-start" in e and "b-sent" in e:
                ph["B_prefix"] = e["b-sent"] - e["b-start"]
            if "b-sent" in e and "b-token" in e:
                ph["pair_wait+step"] = e["b-token"] - e["b-sent"]
            groups[kind].append(ph)
        print(f"{tag} {mode}: {len(rows)} requests, medians in s (and p90 TTFT) by path")
        for kind, xs in sorted(groups.items()):
            keys = [
                k
                for k in ("to_engine", "hold", "A_queue", "handover", "B_queue", "B_prefix", "pair_wait+step", "A_step")
                if any(k in x for x in xs)
            ]
            tt = sorted(x["ttft"] for x in xs)
            print(
                f"  {kind:22s} n={len(xs):3d} ttft {med(tt)} (p90 {tt[int(0.9 * (len(tt) - 1))]:.2f}, max "
                f"{tt[-1]:.2f}) | "
                + " ".join(f"{k} {med([x[k] for x in xs if k in x])}" for k in keys)
            )
        worst = sorted((x for xs in groups.values() for x in xs), key=lambda x: -x["ttft"])[:3]
        print("  worst: " + "; ".join(
            f"#{int(x['i'])} at {x['at']:.1f}s ttft {x['ttft']:.2f} ("
            + ", ".join(f"{k} {v:.2f}" for k, v in x.items() if k not in ("ttft", "i", "at")) + ")" for x in worst))


if __name__ == "__main__":
    logdir = Path(sys.argv[1])
    for tag in sys.argv[2:] or ("k17a", "k17p2", "k17p4"):
        report(logdir, tag)
