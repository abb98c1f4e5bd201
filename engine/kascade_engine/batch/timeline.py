"""Per-request timeline, for benchmarks' latency breakdowns (bench/live.py, issue 17): one INFO line per
event on the `kascade_engine.batch.timeline` logger, `t=<unix s> <event> <request> key=value ...`. Costs nothing
unless the engine logs at INFO (`kascade -v engine serve`).

Events: `submit` (the HTTP request reached the engine), on a loading engine B `b-plan` (its ZigZag split
k), `b-release` (its prefix landed after a hold), `b-start` (first scheduled), `b-sent` (its first rows
went out in a pair step), `b-token` (its first token landed), `b-took` (a request the source handed
over arrived); on the source A `a-start` (an own request first scheduled), `a-redirect` (handed to the
pair), `a-step` (one step: own tokens, pair rows hosted, seconds); on a loading engine `block` (a block of
its load plan became resident: the block id in the request's place).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("kascade_engine.batch.timeline")


def on() -> bool:
    return log.isEnabledFor(logging.INFO)


def mark(event: str, rid: str, **fields: object) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("t=%.4f %s %s %s", time.time(), event, rid, " ".join(f"{k}={v}" for k, v in fields.items()))
