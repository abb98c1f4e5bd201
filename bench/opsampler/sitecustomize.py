"""A sampling profiler for a benchmarked operator process (py-spy is not available here).

Python imports `sitecustomize` at start-up from the path; bench/operator_scale.py puts this directory on the
operator's PYTHONPATH when `KASCADE_SAMPLE_OUT` is set. A daemon thread then reads the main thread's stack
(`sys._current_frames`: the asyncio loop runs every round there) every `KASCADE_SAMPLE_MS` (default 5 ms) and
counts (a) each function as the innermost frame ("self") and (b) each function anywhere on the stack
("total"), and rewrites `KASCADE_SAMPLE_OUT` (JSON) every 2 s, so a SIGKILLed process leaves its profile.
Counting is cheap beside a 5 ms period; samples are only taken while `KASCADE_SAMPLE_ON` exists as a file
(the benchmark creates it for its measured window).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter


def _where(code: object) -> str:
    c = code  # a code object
    return f"{c.co_filename.rsplit('/site-packages/', 1)[-1]}:{c.co_name}"  # type: ignore[attr-defined]


def _run(out: str, period: float, gate: str) -> None:
    main = threading.main_thread().ident
    own, total = Counter[str](), Counter[str]()
    n, last = 0, time.monotonic()
    while True:
        time.sleep(period)
        if os.path.exists(gate):
            f = sys._current_frames().get(main or 0)
            if f is not None:
                n += 1
                own[_where(f.f_code)] += 1
                seen = set()
                while f is not None:
                    w = _where(f.f_code)
                    if w not in seen:
                        seen.add(w)
                        total[w] += 1
                    f = f.f_back
        if time.monotonic() - last > 2.0:
            last = time.monotonic()
            tmp = out + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({"samples": n, "period_s": period, "self": own.most_common(60),
                           "total": total.most_common(120)}, fh)
            os.replace(tmp, out)


if os.environ.get("KASCADE_SAMPLE_OUT"):
    threading.Thread(target=_run, args=(os.environ["KASCADE_SAMPLE_OUT"],
                                        float(os.environ.get("KASCADE_SAMPLE_MS", "5")) / 1000,
                                        os.environ.get("KASCADE_SAMPLE_ON", "/nonexistent")),
                     daemon=True, name="kascade-sampler").start()
