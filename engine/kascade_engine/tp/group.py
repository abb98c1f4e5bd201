"""A tensor-parallel instance's process group: `tp` processes joined by torch.distributed, gloo on CPU (the
all-reduces and the control channel) or NCCL on CUDA (the all-reduces; control stays on a gloo group, since the
step message is a host object).

Data flow: `join(rank, tp, init, device)` blocks until all `tp` ranks met at the rendezvous `init`
(tcp://host:port, rank 0 serves the store; up to RENDEZVOUS_TIMEOUT) -> `RankGroup.reduce(t)` sums a
row-parallel partial output across ranks in place (LlamaModel.reduce; the default group, `timeout_s`) ->
`RankGroup.control` (a gloo group of its own whose timeout is days: an idle instance's followers wait there for
the next message) carries step.py's messages. A rank that dies closes its sockets: the others' next collective
raises (gloo) or times out after `timeout_s`, and they fail (leader.py, rank.py).
UNVERIFIED without a GPU: the NCCL path (backend "nccl", one device per rank) is written but never ran here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


@dataclass
class RankGroup:
    rank: int
    tp: int
    device: torch.device
    control: dist.ProcessGroup | None  # the step channel (gloo, CONTROL_TIMEOUT); None: the default group

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# How long a follower waits for rank 0's next message: an idle instance (no request) sends none, and a gloo receive
# fails once it waited longer than its group's timeout, so the control group's is days, not the all-reduces' seconds.
# A rank that dies still fails the others' pending receive at once (its sockets close); only a hung rank 0 is
# waited on (its own step's collectives, on the default group, time out after `timeout_s`).
CONTROL_TIMEOUT = datetime.timedelta(days=7)


# How long the ranks wait for each other at the rendezvous, whatever the all-reduces' `timeout_s` (with one timeout
# for both, a follower whose start took 1 s longer than rank 0's failed the test's 1 s group). Also how long rank 0
# waits on a follower that died before it joined (its plane failed at start) before the start fails: longer made
# such a start hang past the test's 300 s (a 5 min wait was tried); a big model's ranks that load their shares at
# different speeds may want more, which nothing here measures.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)


def join(rank: int, tp: int, init: str, device: torch.device, timeout_s: float = 60.0,
         rendezvous: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> RankGroup:
    """Meet the other ranks at `init` (tcp://host:port; rank 0 serves the store), waiting up to `rendezvous` for them;
    the all-reduces then time out after `timeout_s`."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    url = urlsplit(init)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init: {init!r} is not tcp://host:port")
    store = dist.TCPStore(  # type: ignore[attr-defined]  # exported at run time, not in the stubs
        url.hostname, url.port, tp, is_master=rank == 0, timeout=rendezvous)
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # every rank creates it, in the same order
    return RankGroup(rank, tp, device, control)
