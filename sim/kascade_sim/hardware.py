"""Hardware and model presets: the cluster (planner `Topology`) and the per-model engine cost model.

Data flow: a preset name (or a user dict) -> `Hardware` (links per GPU, GPUs per host, hosts per
leaf, GPU memory) -> `topology()` for the planner; `ModelSpec` -> `EngineCost` (prefill and decode
iteration times linear in batched tokens, calibratable by `EngineCost.fit`) and KV capacity.
BlitzScale's testbed: 100 Gbps RDMA, 1.6 Tbps NVLink, 128 Gbps PCIe, 10 Gbps SSD per GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kascade_planner.plan import ModelLayout
from kascade_planner.topology import Node, Topology


@dataclass(frozen=True)
class Hardware:
    name: str
    hosts: int = 4
    gpus_per_host: int = 8
    hosts_per_leaf: int = 4
    rdma_gbps: float = 100.0
    nvlink_gbps: float = 1600.0
    pcie_gbps: float = 128.0
    ssd_gbps: float = 10.0
    gpu_mem_gb: float = 80.0
    inter_leaf_ratio: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not v > 0:
                raise ValueError(f"hardware.{f.name} must be > 0, got {v}")

    @property
    def total_gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    def topology(self) -> Topology:
        nodes = tuple(Node(f"host-{h}", f"leaf-{h // self.hosts_per_leaf}", f"host-{h}", self.gpus_per_host,
                           self.rdma_gbps) for h in range(self.hosts))
        return Topology(nodes, self.inter_leaf_ratio, self.nvlink_gbps, self.pcie_gbps, self.ssd_gbps)


def _presets() -> dict[str, Hardware]:
    return {
        "a800": Hardware("a800"),  # BlitzScale cluster A: A800 80GB, 100 Gbps RDMA per GPU
        "a100": Hardware("a100", gpu_mem_gb=40.0),  # cluster B: A100 40GB
        # Every link effectively instant: every system must converge (sanity check).
        "infinite": Hardware("infinite", rdma_gbps=1e12, nvlink_gbps=1e12, pcie_gbps=1e12, ssd_gbps=1e12),
    }


def hardware(name_or_doc: str | Mapping[str, Any], **overrides: Any) -> Hardware:
    """A preset by name, or a user-defined dict (keys as the dataclass fields), then overrides."""
    if isinstance(name_or_doc, str):
        presets = _presets()
        if name_or_doc not in presets:
            raise ValueError(f"unknown hardware preset {name_or_doc!r} (choose {', '.join(presets)})")
        hw = presets[name_or_doc]
    else:
        known = {f.name for f in fields(Hardware)}
        bad = sorted(set(name_or_doc) - known)
        if bad:
            raise ValueError(f"hardware: unknown field(s) {', '.join(bad)}")
        hw = Hardware(**{"name": "custom", **name_or_doc})
    return replace(hw, **overrides) if overrides else hw


@dataclass(frozen=True)
class EngineCost:
    """Iteration times in seconds: prefill = p0 + p1 * batched prompt tokens;
    decode = d0 + d1 * batch size + d2 * KV tokens attended."""

    p0: float = 0.010
    p1: float = 1.0e-4
    d0: float = 0.012
    d1: float = 1.0e-4
    d2: float = 2.0e-8

    def prefill_s(self, tokens: int) -> float:
        return self.p0 + self.p1 * tokens

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        return self.d0 + self.d1 * batch + self.d2 * kv_tokens

    @staticmethod
    def fit(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, int, float]]) -> EngineCost:
        """Least-squares calibration from measured (tokens, seconds) and (batch, kv_tokens, seconds)."""
        import numpy as np

        if len(prefill) < 2 or len(decode) < 3:
            raise ValueError("calibration needs >= 2 prefill and >= 3 decode measurements")
        a = np.array([[1.0, t] for t, _ in prefill])
        (p0, p1), *_ = np.linalg.lstsq(a, np.array([s for _, s in prefill]), rcond=None)
        b = np.array([[1.0, n, kv] for n, kv, _ in decode])
        (d0, d1, d2), *_ = np.linalg.lstsq(b, np.array([s for *_, s in decode]), rcond=None)
        return EngineCost(float(p0), float(p1), float(d0), float(d1), float(d2))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_gb: float  # weights in bytes / 1e9 (bf16)
    layers: int
    kv_bytes_per_token: int
    cost: EngineCost
    tp: int = 1
    max_prefill_tokens: int = 8192
    max_batch: int = 256

    def layout(self) -> ModelLayout:
        return ModelLayout.uniform(self.name, self.layers, int(self.params_gb * 1e9))

    def kv_capacity_tokens(self, hw: Hardware) -> int:
        free = (hw.gpu_mem_gb * self.tp - self.params_gb) * 0.9e9
        if free <= 0:
            raise ValueError(f"model {self.name} ({self.params_gb} GB) does not fit {self.tp} x {hw.gpu_mem_gb} GB")
        return int(free / self.kv_bytes_per_token)


def model(name: str) -> ModelSpec:
    # Llama-3-8B: 32 layers, GQA 8 KV heads x 128 dims x 2 (K,V) x 2 bytes x 32 layers = 128 KiB/token.
    presets = {
        "llama3-8b": ModelSpec("llama3-8b", 16.0, 32, 131072, EngineCost()),
        "mistral-24b": ModelSpec("mistral-24b", 48.0, 40, 163840,
                                 EngineCost(0.02, 3.0e-4, 0.03, 2.5e-4, 5e-8), tp=2),
    }
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r} (choose {', '.join(presets)})")
    return presets[name]
