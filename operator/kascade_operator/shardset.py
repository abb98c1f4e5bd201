"""The shards this process holds right now, and what waits on them (no API calls: shardlead.py holds the Leases).

Data flow: shardlead.py -> `hold(k)` / `drop(k)` -> readers in the handlers and the rounds:
- `owns(pool_ns)`: a service whose pool is in `pool_ns` gets rounds here (rounds.wake, the queued round, the
  metric sweep's engines, kopf's change handlers); everything else is dropped before any work.
- `on_hold` callbacks: a shard just taken over queues a round for each of its services (handlers.py), as kopf's
  resume handlers do at start-up.
- `wait_owned(pool_ns)` / `wait_dropped(pool_ns)`: a ScalePlan's daemon waits until its shard is held here, and
  is cancelled when the shard is given back (plandriver resumes it from its status in the next holder).
- `running(pool_ns)` counts rounds and plan drivers of a shard in progress (`busy`): a shard is given back
  only once they are done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from kascade_operator.sharding import shard_of


class ShardSet:
    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.held: set[int] = set()
        self._of: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._running: dict[int, int] = {}
        self._on_hold: list[Callable[[int], None]] = []

    def shard(self, pool_ns: str) -> int:
        k = self._of.get(pool_ns)
        if k is None:
            k = self._of[pool_ns] = shard_of(pool_ns, self.shards)
        return k

    def owns(self, pool_ns: str) -> bool:
        return self.shard(pool_ns) in self.held

    def on_hold(self, fn: Callable[[int], None]) -> None:
        self._on_hold.append(fn)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def hold(self, k: int) -> None:
        self.held.add(k)
        self._signal()
        for fn in self._on_hold:
            fn(k)

    def drop(self, k: int) -> None:
        self.held.discard(k)
        self._signal()

    async def wait_owned(self, pool_ns: str) -> None:
        while not self.owns(pool_ns):
            await self._changed.wait()

    async def wait_dropped(self, pool_ns: str) -> None:
        while self.owns(pool_ns):
            await self._changed.wait()

    @contextlib.contextmanager
    def running(self, pool_ns: str) -> Iterator[None]:
        k = self.shard(pool_ns)
        self._running[k] = self._running.get(k, 0) + 1
        try:
            yield
        finally:
            self._running[k] -= 1

    def busy(self, k: int) -> int:
        """Rounds and plan drivers of shard k still running (after `drop(k)` no new one starts)."""
        return self._running.get(k, 0)
