"""Waiting for a condition on a live system (control plane, engines): poll a predicate until it
returns something truthy, or fail naming what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Timeout(AssertionError):
    """What was awaited did not happen in time (an AssertionError, so tests report it as a failure)."""


def _ready(pred: Callable[[], T], end: float, timeout: float, what: str) -> T:
    """One poll: `pred()`'s value; past `end` a falsy one raises Timeout naming `what`."""
    v = pred()
    if not v and time.monotonic() >= end:
        raise Timeout(f"timed out after {timeout:.0f} s waiting for {what}")
    return v


def wait_for(pred: Callable[[], T], timeout: float = 30.0, what: str = "a condition", poll: float = 0.1) -> T:
    """The first truthy value of `pred()` within `timeout` seconds."""
    end = time.monotonic() + timeout
    while not (v := _ready(pred, end, timeout, what)):
        time.sleep(poll)
    return v


async def wait_until(pred: Callable[[], T], timeout: float = 30.0, what: str = "a condition", poll: float = 0.01) -> T:
    """`wait_for` inside an event loop: the loop keeps running (and the awaited work with it) between polls."""
    end = time.monotonic() + timeout
    while not (v := _ready(pred, end, timeout, what)):
        await asyncio.sleep(poll)
    return v
