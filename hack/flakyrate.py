"""Failure rate per test: run chosen tests N times, each run a fresh pytest process, and report how often
each test failed (`make flaky TESTS="tests/e2e/test_real_engines.py::test_x" N=10`).

A fresh process per run, like a fresh CI run: module and session fixtures (control planes, engines, caches)
are built again every time, so a test that depends on what an earlier test left behind shows up too.
`--load K` adds K busy CPU processes for the duration (a loaded machine, which is where timing bugs show).
Each run gets its own `--basetemp` under `--keep` (default a fresh /tmp/flakyrate-* directory): a passing run's is
deleted, a failing run's is kept and named (its engine, operator and control-plane logs are what explain a flake;
pytest's own rotation of three base temps would lose them to any other pytest on the machine).

Data flow: `main()` -> N x `python -m pytest -p flakyrate <tests>` with FLAKYRATE_OUT naming a JSON-lines
file -> this module, loaded as a pytest plugin, appends one line per test phase (`pytest_runtest_logreport`)
-> `tally()` (pure: node id -> runs, failures) -> the table, worst first. Exit status 1 when any test failed
at least once (or a run collected nothing), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV_OUT = "FLAKYRATE_OUT"


def pytest_runtest_logreport(report: Any) -> None:
    """Plugin hook (pytest): one line per phase (setup, call, teardown) of every test."""
    out = os.environ.get(ENV_OUT)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}) + "\n")


def tally(lines: Iterable[dict[str, str]]) -> dict[str, str]:
    """One run's phases -> node id -> "failed" (any phase failed: an error in setup/teardown counts),
    "skipped", or "passed"."""
    out: dict[str, str] = {}
    for r in lines:
        was = out.get(r["nodeid"])
        if r["outcome"] == "failed":
            out[r["nodeid"]] = "failed"
        elif r["outcome"] == "skipped" and was != "failed":
            out[r["nodeid"]] = "skipped"
        elif was is None:
            out[r["nodeid"]] = "passed"
    return out


def table(runs: list[dict[str, str]]) -> list[tuple[str, int, int, int]]:
    """(node id, runs it ran in, failures, skips) per test, most failures first."""
    ids = sorted({t for r in runs for t in r})
    rows = [(t, sum(t in r for r in runs), sum(r.get(t) == "failed" for r in runs),
             sum(r.get(t) == "skipped" for r in runs)) for t in ids]
    return sorted(rows, key=lambda row: (-row[2], row[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--runs", type=int, default=10, help="pytest runs (default 10)")
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes beside the runs (default 0)")
    ap.add_argument("--show-all", action="store_true", help="list tests that never failed too")
    ap.add_argument("--keep", type=Path, default=None,
                    help="directory for the runs' temp dirs; failing runs' are kept there (default /tmp/flakyrate-*)")
    ap.add_argument("tests", nargs=argparse.REMAINDER,
                    help="pytest arguments after these options (or after --): node ids, paths, -m/-k expressions")
    a = ap.parse_args(argv)
    tests = a.tests[1:] if a.tests[:1] == ["--"] else a.tests
    if a.runs < 1:
        ap.error(f"--runs: {a.runs}; at least 1")
    if not tests:
        ap.error("no tests: name them (pytest node ids or paths), e.g. tests/e2e/test_real_engines.py::test_x")
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "hack"), os.environ.get("PYTHONPATH")])),
    }
    # a SIGTERM (`pkill -f flakyrate`) must end the burners too: as SystemExit, the `finally` below kills them
    # (left to the default action they outlived this process and kept two CPUs busy for hours)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)]
    runs: list[dict[str, str]] = []
    empty = 0
    keep = a.keep or Path(tempfile.mkdtemp(prefix="flakyrate-"))
    keep.mkdir(parents=True, exist_ok=True)
    kept: list[Path] = []
    try:
        for i in range(a.runs):
            base = keep / f"run{i + 1}"
            shutil.rmtree(base, ignore_errors=True)
            out = keep / f"run{i + 1}.jsonl"
            out.unlink(missing_ok=True)
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "flakyrate", "-q", "--no-header",
                                  "-p", "no:cacheprovider", f"--basetemp={base}", *tests], cwd=root,
                                 env={**env, ENV_OUT: str(out)})
            lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
            run = tally(lines)
            runs.append(run)
            failed = sorted(t for t, o in run.items() if o == "failed")
            empty += not run
            if failed or rc:
                kept.append(base)
            else:
                shutil.rmtree(base, ignore_errors=True)
            print(f"== flaky run {i + 1}/{a.runs}: rc {rc}, {len(run)} tests, {len(failed)} failed, "
                  f"{time.monotonic() - t0:.0f} s" + "".join(f"\n   FAILED {t}" for t in failed)
                  + (f"\n   logs kept: {base}" if failed or rc else ""), flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    rows = table(runs)
    shown = [r for r in rows if r[2] or a.show_all]
    print(f"\n== failure rate over {a.runs} runs{f' (load {a.load})' if a.load else ''}: "
          f"{sum(1 for r in rows if r[2])} of {len(rows)} tests failed at least once")
    for t, ran, failed, skipped in shown:
        print(f"{failed:4d}/{ran:<4d} {100 * failed / ran:5.1f}%  {t}" + (f"  ({skipped} skipped)" if skipped else ""))
    if kept:
        print("logs of the failing runs: " + " ".join(map(str, kept)))
    elif a.keep is None:
        shutil.rmtree(keep, ignore_errors=True)
    if empty:
        print(f"{empty} run(s) collected no tests", file=sys.stderr)
    return 1 if empty or any(r[2] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
