"""Scale to and from zero (replicas.min 0): the router's demand brings the first replica back, an idle
time releases the last one, and nothing else ever drains the last copy."""

from __future__ import annotations

import pytest
from builders import pod, spec

from kascade_operator.demand import Demand, zero_rule
from kascade_operator.reconcile import CreatePlan, Drain, reconcile


@pytest.mark.parametrize(("current", "lo", "wish", "demand", "idle", "want", "why", "last", "router"), [
    (0, 0, 0, Demand(queued=2), None, 1, "scaling from zero", False, False),  # held requests, no replica: one
    (0, 0, 3, Demand(in_flight=1), None, 3, "scaling from zero", False, False),  # the policy may want more
    (0, 0, 1, Demand(), None, 0, None, False, False),  # no demand: stay at zero (the policy would keep a copy)
    (0, 0, 1, None, None, 1, None, False, False),  # no router: nothing could scale it back up, keep a copy
    (1, 0, 0, None, 999.0, 1, None, False, False),  # no router: never released
    (1, 0, 0, Demand(), 301.0, 0, "idle for 301 s", True, False),  # idle long enough: the last copy goes
    (1, 0, 0, Demand(), 10.0, 1, None, False, False),  # below the policy's bound, not idle long: keep one
    (1, 0, 0, Demand(queued=1), 999.0, 1, None, False, False),  # a held request is never idle
    (1, 1, 0, Demand(), 999.0, 0, None, False, False),  # min 1: the policy's wish, the reconciler keeps the copy
    (2, 0, 2, Demand(), 0.0, 2, None, False, False),
    (0, 0, 1, None, None, 0, None, False, True),  # router configured but not readable yet: stay at zero
    (1, 0, 0, None, 999.0, 1, None, False, True),  # router unreadable: the last copy is never released
])
def test_zero_rule(current: int, lo: int, wish: int, demand: Demand | None, idle: float | None, want: int,
                   why: str | None, last: bool, router: bool) -> None:
    got, reason, release_last = zero_rule(current, lo, wish, demand, idle, 300.0, router)
    assert got == want and release_last == last
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_from_zero_loads_the_first_copy_from_the_source() -> None:
    res = reconcile("svc", spec(lo=0, hi=2), [pod("p-a")], [], {"colocated": 1}, "router demand")
    assert res.actions == (CreatePlan("colocated", (), ("p-a",), "router demand"),)  # no source pod: spec.model.source


def test_last_copy_drains_only_when_released() -> None:
    one = [pod("r1", ms="svc", role="colocated", ready=True)]
    assert reconcile("svc", spec(lo=0, hi=2), one, [], {"colocated": 0}).actions == ()
    res = reconcile("svc", spec(lo=0, hi=2), one, [], {"colocated": 0}, release_last={"colocated"})
    assert res.actions == (Drain("r1"),) and res.available  # desired 0: nothing is missing
