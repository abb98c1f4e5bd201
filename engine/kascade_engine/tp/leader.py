"""Rank 0 of a tensor-parallel instance: the ordinary Engine (scheduler, page tables, sampling, HTTP above it)
whose every forward is first announced to the follower ranks (step.py), then run over rank 0's own slices; the
model's two all-reduces per layer meet the followers' running the same step.

Failure: a follower that dies makes the next collective raise (gloo: connection closed) or time out; the
instance is then broken for good, so `TPEngine` records it (`failed`), fails the step's requests, and raises
`RankLost` from every later step; launch.py's watcher records a follower's exit the same way even between steps,
and the server exits non-zero on it (the pod restarts; the operator replaces the replica).

Disaggregated serving, "gathered at rank 0" (kv.py): `read_kv` gathers every rank's KV heads of a request's slots
into the whole model's layout (what a prefill engine ships), `write_kv` scatters a received whole KV to the ranks (a
decode engine adopting a prompt); `layerwise` is False, so the prefill server runs the step whole and ships after it.

One channel, one user at a time: a message sent from another thread (a plan's `Serve`, a `Manifests` query, asked
over HTTP while the instance serves) must never interleave with a step's message on the control group, nor fall
between a step's message and its all-reduces. `channel` (a lock) is held across each step's message and forward and
across every other message with its collective.

Live pairing (live/cooperation.py): a live pair's forward runs rows over different layer ranges (`staggered`); each
segment is `run_rows`, which sends the followers a `Layers` message carrying rank 0's hidden states of the rows (whole
after each all-reduce) and the rows' page tables; every rank runs those layers on its heads and its pages (a pair's
private pages included), so every rank holds its heads' share of the pair's KV. Activations cross to the peer at rank
0 only; `read_kv` / `write_kv` move a migrated sequence's KV (live/migration.py) as they move PD's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from kascade_engine.batch.engine import Engine, Event
from kascade_engine.batch.scheduler import Limits
from kascade_engine.tp import kv
from kascade_engine.tp import step as msg
from kascade_engine.tp.group import RankGroup
from kascade_engine.tp.rankmodel import RankModel


class RankLost(RuntimeError):
    """A rank of this tensor-parallel instance is gone: the instance cannot compute any more."""


class TPEngine(Engine):
    def __init__(self, model: RankModel, group: RankGroup, limits: Limits | None = None,
                 eos: int | None = None) -> None:
        super().__init__(model, limits, eos)
        self.model: RankModel = model
        self.group = group
        self.tp = group.tp
        self.failed: str | None = None
        self.on_lost: Callable[[str], None] | None = None  # once, when a rank is gone (the server exits)
        self.channel = threading.Lock()  # the control group: one message (and its collectives) at a time
        self.loads = 0  # Load messages sent (the followers count them too: an Abort names its load)
        model.reduce = group.reduce

    def lost(self, why: str) -> None:
        """A rank is gone (a collective failed here, or launch.py saw a follower exit)."""
        if self.failed is None:
            self.failed = why
            if self.on_lost is not None:
                self.on_lost(why)

    def step(self) -> list[Event]:
        if self.failed is not None:
            raise RankLost(self.failed)
        return super().step()

    @contextlib.contextmanager
    def _collective(self, what: str, m: Any) -> Iterator[None]:
        """Send every follower `m` and run the collective it starts, holding the step channel; a gloo error (a
        peer closed its connection: any rank's error breaks the instance) marks the instance lost, naming `what`."""
        try:
            with self.channel:
                msg.send(m, self.group.control)
                yield
        except RuntimeError as e:
            self.lost(f"a tensor-parallel rank failed {what}: {e}")
            raise RankLost(str(self.failed)) from e

    def _hidden(self, ids: list[int], items: list[tuple[list[int], int, int]]) -> torch.Tensor:
        with self._collective("during a step", msg.Step(ids, [(list(t), start, n) for t, start, n in items])):
            return super()._hidden(ids, items)

    # -- a live pair's partial forwards (live/cooperation.py): the hidden states at rank 0, broadcast per segment ----
    def run_rows(self, first: int, last: int, x: torch.Tensor,
                 items: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Every rank runs layers first..last-1 over rank 0's hidden states `x` (sent with the message) on its own
        heads and its own pages at rank 0's slots; the all-reduces make the result whole here again."""
        if self.failed is not None:
            raise RankLost(self.failed)
        m = msg.Layers(first, last, [(list(t), start, n) for t, start, n in items], x.detach().cpu())
        with self._collective("during a live pair's layers", m):
            return super().run_rows(first, last, x, items)

    # -- a request's KV, gathered at rank 0 (disaggregated serving; kv.py) ----------------------------------------
    layerwise = False  # the followers run a step's layers as one message: the KV leaves after the step

    @property
    def kv_heads(self) -> int:
        return self.model.layout.kv_heads

    def read_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's K and V of `slots`: every rank's heads, gathered here (a collective)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        at = slots.tolist()
        with self._collective("gathering KV", msg.GatherKV(at)):
            return kv.gather(self.model.layout, self.cache, at, self.group.control)

    def write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The whole model's K and V of `slots` in: every rank gets its heads (a collective)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        at = slots.tolist()
        with self._collective("receiving KV", msg.ScatterKV(at)):
            kv.scatter(self.model.layout, self.cache, at, k, v, self.group.control)

    def load_planes(self, planes: list[dict[str, Any]]) -> int:
        """Send every follower its plane (rank r receives planes[r] in the background and goes on following steps);
        rank 0 receives planes[0] itself, then polls `load_progress` and installs by `install_blocks`
        (progressive.py, planload.py). Returns the load's number (`abort_load` names it)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        with self.channel:
            msg.send(msg.Load(planes), self.group.control)
            self.loads += 1
            return self.loads

    def load_progress(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's report of its plane (rank 0's is `mine`), in rank order: a collective (call it off the loop)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        said: list[Any] = [None] * self.group.tp
        with self._collective("reporting its load", msg.Progress()):
            dist.all_gather_object(said, mine, group=self.group.control)
        return [dict(x) for x in said]

    def install_blocks(self, blocks: list[str], here: Callable[[], None]) -> None:
        """Every rank installs `blocks` from its verified shares; `here` installs rank 0's (parts: the all-gather
        with the followers, a collective; a digest that fails after it fails the instance)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        with self._collective("installing blocks", msg.Install(list(blocks))):
            here()

    def abort_load(self, reason: str, load: int) -> None:
        """Every follower stops receiving its plane of load number `load` (one it received a later Load after
        ignores it); best effort: a broken instance has nobody to tell."""
        if self.failed is None:
            with contextlib.suppress(RuntimeError), self.channel:
                msg.send(msg.Abort(reason, load), self.group.control)

    def load_path(self, path: str) -> None:
        """Every follower packs checkpoint `path` and keeps its slices (rank 0 loads its own: loader.py)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        with self.channel:
            msg.send(msg.LoadPath(path), self.group.control)

    def serve_planes(self, planes: list[dict[str, Any]]) -> None:
        """Matched TP, this instance a source: every follower sends its slices in its plane (planes[r]) from its
        own data port, in the background (rank 0 serves planes[0] itself: planload.py)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        with self.channel:
            msg.send(msg.Serve(planes), self.group.control)

    def slice_manifests(self, model: str) -> dict[str, dict[str, Any]]:
        """Every rank's slice blocks' manifest (`<block>@r/tp` entries), merged: what a matched-TP target verifies.
        A collective over the control group (blocking: call it off the event loop)."""
        if self.failed is not None:
            raise RankLost(self.failed)
        mine = self.model.slice_set(model).manifest()
        said: list[Any] = [None] * self.group.tp
        try:
            with self.channel:
                msg.send(msg.Manifests(model), self.group.control)
                dist.all_gather_object(said, mine, group=self.group.control)
        except RuntimeError as e:
            self.lost(f"a tensor-parallel rank failed answering its slice manifest: {e}")
            raise RankLost(str(self.failed)) from e
        out: dict[str, dict[str, Any]] = {}
        for m in said:
            out.update(m)
        return out

    def shutdown(self, reason: str = "shutdown") -> None:
        """Tell the followers to exit (best effort: a broken instance has nobody to tell)."""
        if self.failed is None:
            with contextlib.suppress(RuntimeError), self.channel:
                msg.send(msg.Stop(reason), self.group.control)
        self.group.close()
