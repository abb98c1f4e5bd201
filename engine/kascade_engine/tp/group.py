"""A tensor-parallel instance's process group: `tp` processes joined by torch.distributed, gloo on CPU (the
all-reduces and the control channel) or NCCL on CUDA (the all-reduces; control stays on a gloo group, since the
step message is a host object).

Data flow: `join(rank, tp, init, device)` blocks until all `tp` ranks met at the rendezvous `init`
(tcp://host:port, rank 0 listens) -> `RankGroup.reduce(t)` sums a row-parallel partial output across ranks in
place (LlamaModel.reduce) -> `RankGroup.control` carries step.py's messages. A rank that dies closes its sockets:
the others' next collective raises (gloo) or times out after `timeout_s`, and they fail (leader.py, rank.py).
UNVERIFIED without a GPU: the NCCL path (backend "nccl", one device per rank) is written but never ran here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RankGroup:
    rank: int
    tp: int
    device: torch.device
    control: dist.ProcessGroup | None  # None: the default group (gloo) carries control too

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join(rank: int, tp: int, init: str, device: torch.device, timeout_s: float = 60.0) -> RankGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return RankGroup(rank, tp, device, control)
