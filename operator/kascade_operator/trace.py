"""Timestamps along a reaction's path, for finding where the time goes (bench/operator_scale.py reads them).

Each event is one DEBUG line of the logger `kascade_operator.trace`: `trace <event> <ns>/<name> <t>`,
t = time.monotonic() (system-wide on Linux, so comparable with the engine stand-ins' clocks). Events:
`wake` (the sweep saw the service's loads change), `take` (a worker takes the service's queued round; with
its lateness in seconds and its kind, change or resync), `start` (that round begins),
`decided` (decide() returned actions), `plan` (a ScalePlan was created), `instructed` (its targets were told to
bind). Off unless that logger is at DEBUG (`KASCADE_DEBUG_LOGGERS=kascade_operator.trace`, cli logsetup):
the check is one `isEnabledFor` per event.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def event(what: str, key: tuple[str, str], detail: str = "") -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("trace %s %s/%s %.4f%s", what, key[0], key[1], time.monotonic(), f" {detail}" if detail else "")
