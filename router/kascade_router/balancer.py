"""Pick a backend for one request: power of two choices on outstanding requests, weighted.

Two distinct usable backends are sampled at random and the one with the lower (in-flight + 1) / weight
wins: near-least-loaded without scanning or herding (every router replica alone sees only its own
in-flight counts, and random sampling keeps several replicas from piling onto one engine). A live
(loading) replica has a smaller weight, so it takes a smaller share until it holds every layer.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from kascade_router.backends import Backend


def pick(backends: Sequence[Backend], rng: random.Random, exclude: Collection[str] = ()) -> Backend | None:
    pool = [b for b in backends if b.pod not in exclude] if exclude else list(backends)
    if not pool:
        return None
    if len(pool) == 1:
        return pool[0]
    a, b = rng.sample(pool, 2)
    return a if (a.in_flight + 1) / a.weight <= (b.in_flight + 1) / b.weight else b
