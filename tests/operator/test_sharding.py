"""Shard assignment and the shard campaign (pure, sharding.py): stable across processes, spread, fair share,
take-over of an expired shard, give-back when a replica joins; and a simulated fleet of replicas converging."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from kascade_operator.sharding import (
    LeaseState,
    campaign,
    fair_share,
    lease_name,
    member_lease_name,
    shard_of,
    stable_hash,
)


def test_the_shard_is_the_same_in_every_process() -> None:
    names = ["default", "team-a", "prod/x", "ns-17"]
    here = [shard_of(n, 7) for n in names]
    code = f"from kascade_operator.sharding import shard_of; print([shard_of(n, 7) for n in {names!r}])"
    for seed in ("1", "2"):  # Python's hash() of a str differs between these two
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(here)
    assert stable_hash("default") == int(subprocess.run(
        [sys.executable, "-c", "from kascade_operator.sharding import stable_hash; print(stable_hash('default'))"],
        env={**os.environ, "PYTHONHASHSEED": "3"}, capture_output=True, text=True, check=True).stdout)


def test_one_shard_owns_everything_and_bad_counts_are_refused() -> None:
    assert {shard_of(f"ns{i}", 1) for i in range(50)} == {0}
    with pytest.raises(ValueError, match="shards: 0"):
        shard_of("x", 0)


def test_namespaces_spread_over_the_shards() -> None:
    counts = Counter(shard_of(f"ns-{i}", 4) for i in range(4000))
    assert set(counts) == {0, 1, 2, 3}
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_lease_names() -> None:
    assert lease_name("kascade-operator", 0, 1) == "kascade-operator"  # one shard: the leader's Lease, as before
    assert lease_name("kascade-operator", 3, 4) == "kascade-operator-3"
    m = member_lease_name("kascade-operator", "Pod_Name-1")
    assert m.startswith("kascade-operator-member-") and m == m.lower() and len(m) < 64
    assert fair_share(4, 3) == 2 and fair_share(2, 0) == 2


def test_settings_refuse_shards_without_leases_or_with_one_shared_pool() -> None:
    from pydantic import ValidationError

    from kascade_operator.settings import OperatorSettings
    assert OperatorSettings().shards == 1
    with pytest.raises(ValidationError, match="KASCADE_OPERATOR_SHARDS 2 needs KASCADE_OPERATOR_LEADER_ELECTION"):
        OperatorSettings(shards=2)
    with pytest.raises(ValidationError, match="KASCADE_OPERATOR_SHARDS 2 with KASCADE_OPERATOR_POOL_NAMESPACE"):
        OperatorSettings(shards=2, leader_election=True, pool_namespace="pool")
    with pytest.raises(ValidationError, match="shards"):
        OperatorSettings(shards=0)
    assert OperatorSettings(shards=4, leader_election=True).shards == 4


FREE = LeaseState(None, True)


def test_a_replica_alone_takes_every_shard() -> None:
    c = campaign("a", 3, {"a"}, {}, set())
    assert c.take == {0, 1, 2} and not c.release


def test_two_replicas_take_one_shard_each_and_leave_a_held_one_alone() -> None:
    c = campaign("a", 2, {"a", "b"}, {}, set())
    assert len(c.take) == 1
    (k,) = c.take
    held_by_a = {k: LeaseState("a", False), 1 - k: FREE}
    cb = campaign("b", 2, {"a", "b"}, held_by_a, set())
    assert cb.take == {1 - k}  # a's shard is not free
    assert not campaign("a", 2, {"a", "b"}, held_by_a, {k}).take  # a is at its fair share


def test_an_expired_shard_is_taken_over_beyond_the_fair_share_when_its_holder_is_gone() -> None:
    leases = {0: LeaseState("a", False), 1: LeaseState("b", True)}
    assert not campaign("a", 2, {"a", "b"}, leases, {0}).take  # b's member Lease still live: fair share 1
    assert campaign("a", 2, {"a"}, leases, {0}).take == {1}  # b gone: a takes its shard


def test_a_replica_gives_back_shards_beyond_its_fair_share_when_another_joins() -> None:
    leases = {0: LeaseState("a", False), 1: LeaseState("a", False)}
    c = campaign("a", 2, {"a", "b"}, leases, {0, 1})
    assert len(c.release) == 1 and not c.take


def test_a_lease_still_naming_me_that_i_do_not_hold_is_mine_to_take() -> None:
    assert campaign("a", 1, {"a"}, {0: LeaseState("a", False)}, set()).take == {0}


def _simulate(replicas: list[str], shards: int, ticks: int,
              holder: dict[int, str | None]) -> dict[int, str | None]:
    """Replicas campaign in turn against one store; a take succeeds only if the shard is still free (a guarded
    write); a give-back frees it at once."""
    for _ in range(ticks):
        for me in replicas:
            held = {k for k, h in holder.items() if h == me}
            leases = {k: LeaseState(h, h is not None and h not in replicas) for k, h in holder.items()}
            c = campaign(me, shards, set(replicas), leases, held)
            for k in c.release:
                holder[k] = None
            for k in c.take:
                if holder.get(k) is None or holder[k] not in replicas or holder[k] == me:
                    holder[k] = me
    return holder


@pytest.mark.parametrize(("n_rep", "shards"), [(2, 2), (3, 8), (4, 4), (2, 5)])
def test_replicas_converge_to_fair_shares_and_take_over_a_dead_ones(n_rep: int, shards: int) -> None:
    reps = [f"op-{i}" for i in range(n_rep)]
    holder = _simulate(reps, shards, 4, {})
    per = Counter(holder.values())
    assert set(holder) == set(range(shards)) and None not in per
    assert max(per.values()) - min(per.values()) <= 1 and len(per) == n_rep, per
    holder = _simulate(reps[1:], shards, 3, holder)  # op-0 dies: its Leases expire, the others take its shards
    per = Counter(holder.values())
    assert set(per) == set(reps[1:]) and sum(per.values()) == shards
    holder = _simulate(reps, shards, 4, holder)  # a new op-0 joins: shards are given back to it
    per = Counter(holder.values())
    assert max(per.values()) - min(per.values()) <= 1 and len(per) == n_rep, per
