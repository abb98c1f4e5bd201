"""Shared benchmark output: a metric table with targets checked, and the JSON results file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def report(name: str, out: Mapping[str, float | str], targets: Mapping[str, tuple[str, float]]) -> None:
    """Print every numeric metric (with `ok`/`MISSED` where a target applies) and write results/NAME.json."""
    width = max([len(k) for k in out] + [6]) + 2
    print(f"\n{'metric':<{width}} {'value':>10}  target")
    for k, v in out.items():
        if isinstance(v, str):
            print(f"{k:<{width}} {v}")
            continue
        note = ""
        if k in targets:
            op, bound = targets[k]
            ok = v <= bound if op == "<=" else v >= bound
            note = f"{op} {bound}  {'ok' if ok else 'MISSED'}"
        print(f"{k:<{width}} {v:>10.3f}  {note}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(dict(out), indent=2) + "\n")
    print(f"wrote {path}")
