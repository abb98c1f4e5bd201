"""Starting and watching a tensor-parallel instance's ranks, from rank 0's process (the one that serves HTTP).

Data flow: `start(tp, checkpoint, ...)` -> a free rendezvous port on 127.0.0.1 (the ranks share the pod) ->
ranks 1..tp-1 as child processes (`python -m kascade_engine.tp.rank`, each its own device on CUDA: cuda:<rank>)
-> rank 0 loads its slices and joins (group.py) -> barrier (every rank loaded) -> a `TPEngine` (leader.py).
A watcher thread waits on every follower: one exiting while the instance runs calls `on_lost` (the engine's
`lost`: later steps raise `RankLost`; the server exits non-zero on it). `Ranks.stop()` sends `Stop`, waits,
and kills whatever did not exit.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kascade_engine.batch.scheduler import Limits
from kascade_engine.tp.group import join
from kascade_engine.tp.leader import TPEngine
from kascade_engine.tp.planes import PlaneSpec, exchange_stats, install, receive_plane_sync
from kascade_engine.tp.rank import exit_lost
from kascade_engine.tp.rankmodel import RankModel
from kascade_engine.tp.shard import TPLayout
from kascade_engine.weights.blocks import BlockSet

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:<base + r> on CUDA (one GPU per rank), the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass
class Ranks:
    engine: TPEngine
    followers: list[subprocess.Popen[bytes]]
    stopping: bool = False
    load_stats: list[Mapping[str, float]] = field(default_factory=list)  # per rank, when loaded by plan
    _watchers: list[threading.Thread] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.followers]

    def watch(self, on_lost: Callable[[str], None]) -> None:
        for r, p in enumerate(self.followers, start=1):
            t = threading.Thread(target=self._wait, args=(r, p, on_lost), daemon=True, name=f"tp-rank-{r}")
            t.start()
            self._watchers.append(t)

    def _wait(self, rank: int, p: subprocess.Popen[bytes], on_lost: Callable[[str], None]) -> None:
        code = p.wait()
        if not self.stopping:
            on_lost(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}")

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        self.engine.shutdown()
        for p in self.followers:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def exit_on_lost(why: str) -> None:
    """The server's `on_lost`: a rank is gone, so the instance cannot compute; exit non-zero at once (no request
    is answered with a partial model; the pod restarts and the operator replaces the replica)."""
    log.error("%s: exiting", why)
    exit_lost()


def start(model_cfg: Mapping[str, Any], checkpoint: Path, tp: int, limits: Limits, device: torch.device,
          dtype: torch.dtype, eos: int | None = None, threads: int = 1, timeout_s: float = 60.0,
          blocks: BlockSet | None = None, on_lost: Callable[[str], None] | None = None,
          planes: Sequence[Path] | None = None, empty: bool = False,
          resident_layers: int | None = None) -> Ranks:
    """Rank 0 here, ranks 1..tp-1 as children loading `checkpoint`; returns once every rank is in and every
    follower holds its weights (rank 0 its own too when `blocks` is given; else they arrive by `add_block`).
    `planes`: one plane spec file per rank (planes.py): every rank loads its share by plan over its own data
    port instead (the checkpoint gives the config only); the ranks' bytes and seconds are `Ranks.load_stats`.
    `empty`: the followers start with no weights; a load plan reaches them later (`TPEngine.load_planes`).
    `on_lost(why)` runs once when a rank is gone (the server exits on it). `resident_layers`: the followers keep
    only embed and that many leading layers of the checkpoint (a load in progress, as `--resident-layers` at tp 1:
    tests and demos of live pairing; rank 0 adds the same blocks itself)."""
    if planes is not None and len(planes) != tp:
        raise ValueError(f"planes: {len(planes)} plane specs for tp {tp} (one per rank)")
    layout = TPLayout.of(model_cfg, tp)
    init = f"tcp://127.0.0.1:{_free_port()}"
    followers = [subprocess.Popen([
        sys.executable, "-m", "kascade_engine.tp.rank", "--rank", str(r), "--tp", str(tp), "--init", init,
        "--checkpoint", str(checkpoint), "--device", str(rank_device(device, r)),
        "--dtype", str(dtype).removeprefix("torch."), "--threads", str(threads),
        "--kv-tokens", str(limits.kv_tokens), "--page-size", str(limits.page_size), "--timeout-s", str(timeout_s),
        *(["--plane", str(planes[r])] if planes is not None else []), *(["--empty"] if empty else []),
        *(["--resident-layers", str(resident_layers)] if resident_layers is not None else []),
    ], stdout=sys.stderr) for r in range(1, tp)]  # stdout stays rank 0's (run.py prints its result there)
    stats: Sequence[Mapping[str, float]] = ()
    try:
        model = RankModel(model_cfg, layout, 0, dtype=dtype, device=device)
        plane = PlaneSpec.read(planes[0]) if planes is not None else None
        got = receive_plane_sync(plane) if plane is not None else None
        if blocks is not None and plane is None:
            model.add_blocks(blocks.blocks.values())
        group = join(0, tp, init, device, timeout_s)
        if plane is not None and got is not None:
            stats = exchange_stats(got, install(model, plane, got, device=device), 0, tp, group.control)
        group.barrier()
    except BaseException:
        for p in followers:
            p.kill()
            p.wait()
        raise
    engine = TPEngine(model, group, limits, eos)
    engine.on_lost = on_lost
    ranks = Ranks(engine, followers)
    ranks.load_stats = list(stats)
    ranks.watch(engine.lost)
    log.info("tensor-parallel instance up: %d ranks (followers %s)", tp, ranks.pids)
    return ranks
