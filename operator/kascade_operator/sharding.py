"""Operator sharding, PURE: which shard a service belongs to, and which shard Leases a replica campaigns for.

Concept: with `shards` N > 1, replicas split the ModelServices between them. A service belongs to shard
`shard_of(pool namespace, N)` — a stable hash (BLAKE2b, not Python's salted `hash()`) of the namespace of
its warm pool, not of the service's own name: every service that shares a pool shares one fleet arbitration
(fleetboard.py: over the pool's idle engines, with preemptions between them), one set of host copies per model
(hostcopykeeper.py, `pool.keep_host_copy`) and one set of idle engines to bind. Those decisions must see every
service of the pool, so the pool namespace is the unit a shard owns; nothing pool-wide is then shared between
shards. The nodes are read-only (every replica watches them). Shard k is held under its own Lease
`<lease_name>-<k>` (N = 1: the Lease `<lease_name>`, today's single leader).

Campaign (`campaign`, run every retry period by shardlead.py over what it listed): a replica's fair share is
ceil(N / live replicas), live = replicas whose member Lease was renewed within the lease duration, itself
included. It campaigns for free shards (no holder, or the holder's Lease unchanged for a lease duration) up to
its fair share, in its rendezvous order (each replica ranks the shards by hash(shard, identity), so replicas
that start together reach for different shards first), and gives back the shards it holds beyond the fair share
(a replica joined), those it ranks lowest. A replica alone takes every shard; two spread 1:1 on 2 shards.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def shard_of(pool_namespace: str, shards: int) -> int:
    """The shard that owns every service whose warm pool is in `pool_namespace`."""
    if shards < 1:
        raise ValueError(f"shards: {shards} (>= 1)")
    return 0 if shards == 1 else stable_hash(pool_namespace) % shards


def lease_name(base: str, shard: int, shards: int) -> str:
    """Shard `shard`'s Lease: `base` itself with one shard (the leader's Lease as before), else `base-<k>`."""
    return base if shards == 1 else f"{base}-{shard}"


def member_lease_name(base: str, identity: str) -> str:
    """A replica's heartbeat Lease (how the others count live replicas): a DNS-safe name from its identity."""
    return f"{base}-member-{stable_hash(identity):016x}"


def fair_share(shards: int, live: int) -> int:
    return math.ceil(shards / max(1, live))


def rank(shard: int, identity: str) -> int:
    """Rendezvous rank: lower is preferred by this replica."""
    return stable_hash(f"{shard}/{identity}")


@dataclass(frozen=True)
class LeaseState:
    """One shard Lease as a replica observed it."""

    holder: str | None  # None: no Lease yet, or released
    expired: bool  # its record has not changed for a lease duration (the holder stopped renewing)

    @property
    def free(self) -> bool:
        return self.holder is None or self.expired


@dataclass(frozen=True)
class Campaign:
    take: frozenset[int]  # free shards to try to acquire now
    release: frozenset[int]  # held shards to give back (beyond the fair share)


def campaign(me: str, shards: int, live: Set[str], leases: Mapping[int, LeaseState], held: Set[int]) -> Campaign:
    """What replica `me`, holding `held`, does this period (module docstring)."""
    fair = fair_share(shards, len(set(live) | {me}))
    mine = sorted(held, key=lambda k: rank(k, me))
    release = frozenset(mine[fair:])
    room = max(0, fair - len(held))
    def free(k: int) -> bool:  # a Lease still naming me that I do not hold: a previous life of this identity
        s = leases.get(k, LeaseState(None, True))
        return s.free or s.holder == me
    free_ks = sorted((k for k in range(shards) if k not in held and free(k)), key=lambda k: rank(k, me))
    return Campaign(frozenset(free_ks[:room]), release)
