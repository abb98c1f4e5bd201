"""What every participant of one weight transfer is told: the plan, the block manifest (sizes,
digests, tensor index), every peer's data address, the plan's token, chunk size and timeouts.

It is JSON on the wire (the engine control API's `load-plan` body, or a file for `kascade transfer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kascade_planner.plan import Plan, PlanError

MAX_TIMEOUT_S = 3600.0  # a peer silent this long is lost; larger values only hide a hang
# The most a plan's blocks may total: every target reserves receive memory for them up front, so a manifest
# claiming more (a 1 TB one was accepted, issue 38) is refused before anything is allocated. 512 GiB holds a
# 256B-parameter model in 16 bits; raise it with the hosts that can hold more.
MAX_MANIFEST_BYTES = 512 << 30


class SpecError(ValueError):
    """A transfer spec that cannot be used; the message names the field."""


@dataclass(frozen=True)
class TransferSpec:
    plan: Plan
    manifest: Mapping[str, Mapping[str, Any]]
    peers: Mapping[str, tuple[str, int]]
    token: str
    chunk_bytes: int = 1 << 20
    timeout_s: float = 10.0
    faults: Mapping[str, Any] = field(default_factory=dict)  # test-only fault injection, per instance
    not_before: float | None = None  # wall clock: sources wait until then, so every peer is listening

    def __post_init__(self) -> None:
        if not self.token:
            raise SpecError("token must not be empty")
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise SpecError(f"chunkBytes must be within [4096, 64 MiB], got {self.chunk_bytes}")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise SpecError(f"timeoutSeconds must be within (0, {MAX_TIMEOUT_S:.0f}], got {self.timeout_s}")
        for k, (_, port) in self.peers.items():
            if not 1 <= port <= 65535:
                raise SpecError(f"peers.{k}: port {port} outside 1..65535")
        total = 0
        for b in self.plan.model.block_ids:
            if b not in self.manifest:
                raise SpecError(f"manifest lacks block {b!r}")
            n = self.manifest[b].get("bytes") if isinstance(self.manifest[b], Mapping) else None
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise SpecError(f"manifest.{b}.bytes must be a non-negative integer, got {n!r}")
            total += n
        if total > MAX_MANIFEST_BYTES:
            raise SpecError(f"manifest totals {total} bytes ({total / 2**30:.1f} GiB), more than the "
                            f"{MAX_MANIFEST_BYTES >> 30} GiB a plan may move")
        for i in (*self.plan.sources, *self.plan.targets):
            if i.kind == "gpu" and i.id not in self.peers:
                raise SpecError(f"peers lacks an address for {i.id!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "manifest": dict(self.manifest),
                "peers": {k: f"{h}:{p}" for k, (h, p) in self.peers.items()}, "token": self.token,
                "chunkBytes": self.chunk_bytes, "timeoutSeconds": self.timeout_s, "faults": dict(self.faults),
                **({"notBefore": self.not_before} if self.not_before is not None else {})}

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> TransferSpec:
        try:
            peers = {}
            for k, v in dict(doc["peers"]).items():
                host, _, port = str(v).rpartition(":")
                if not host or not port.isdigit():
                    raise SpecError(f"peers.{k}: expected host:port, got {v!r}")
                peers[str(k)] = (host, int(port))
            return TransferSpec(Plan.from_dict(doc["plan"]), dict(doc["manifest"]), peers, str(doc["token"]),
                                int(doc.get("chunkBytes", 1 << 20)), float(doc.get("timeoutSeconds", 10.0)),
                                dict(doc.get("faults", {})),
                                float(doc["notBefore"]) if doc.get("notBefore") is not None else None)
        except KeyError as e:
            raise SpecError(f"transfer spec: missing field {e.args[0]!r}") from None
        except PlanError as e:
            raise SpecError(f"transfer spec: plan: {e}") from None


def shard_range(size: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """Byte range [begin, end) of shard (i, g) of a block of `size` bytes (the whole block if None)."""
    if shard is None:
        return 0, size
    i, g = shard
    step = math.ceil(size / g)
    return min(size, i * step), min(size, (i + 1) * step)
