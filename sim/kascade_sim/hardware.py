"""Hardware and model presets: the cluster (planner `Topology`) and the per-model engine cost model.

Data flow: a preset name (or a user dict) -> `Hardware` (links per GPU, GPUs per host, hosts per
leaf, GPU and host memory) -> `topology()` for the planner; `ModelSpec` -> `EngineCost` (prefill and
decode iteration times linear in batched tokens, calibratable by `EngineCost.fit`) and KV capacity.

BlitzScale's clusters (OSDI'25 §7): A = 4 hosts x 8 A800 80 GB, 100 Gbps RDMA, 1.6 Tbps NVLink,
128 Gbps PCIe, 10 Gbps SSD per GPU; B = 2 hosts x 8 A100 80 GB, PCIe 256 Gbps and no NVLink (GPUs
of one host talk over PCIe). B's RDMA speed is not stated where we read it: 100 Gbps per GPU is
assumed (override with `rdma_gbps`).

Engine costs are a roofline, not a measurement: no GPU here, and the engine's CPU step times (SmolLM2
on 2 cores) say nothing about an A800. Prefill runs at 50 % of 312 TFLOPS bf16 per GPU, decode reads
the weights and the KV cache at 80 % of 2.0 TB/s HBM per GPU, tensor parallelism costs +10 % per
doubling, plus 2 ms per iteration. For Llama-3-8B this gives 0.10 ms per prefill token and 12 ms per
decode step, in line with vLLM's published A100 numbers. Calibrate with `EngineCost.fit` from
measured step times when a GPU is available.
"""

from __future__ import annotations

import math
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
    host_mem_gb: float = math.inf  # host DRAM a host may spend on cached model copies

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not v > 0:
                raise ValueError(f"hardware.{f.name} must be > 0, got {v}")
            if isinstance(v, float) and math.isnan(v):
                raise ValueError(f"hardware.{f.name} must be a number, got {v}")
        if self.inter_leaf_ratio > 1:
            raise ValueError(f"hardware.inter_leaf_ratio must be in (0, 1], got {self.inter_leaf_ratio}")

    @property
    def total_gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    def topology(self) -> Topology:
        nodes = tuple(Node(f"host-{h}", f"leaf-{h // self.hosts_per_leaf}", f"host-{h}", self.gpus_per_host,
                           self.rdma_gbps) for h in range(self.hosts))
        return Topology(nodes, self.inter_leaf_ratio, self.nvlink_gbps, self.pcie_gbps, self.ssd_gbps)


def _presets() -> dict[str, Hardware]:
    a = Hardware("a800")  # BlitzScale cluster A
    b = Hardware("a100", hosts=2, pcie_gbps=256.0, nvlink_gbps=256.0)  # cluster B: no NVLink, GPU<->GPU over PCIe
    return {
        "a800": a, "cluster-a": replace(a, name="cluster-a"),
        "a100": b, "cluster-b": replace(b, name="cluster-b"),
        # Every link effectively instant: every system must converge (sanity check).
        "infinite": Hardware("infinite", rdma_gbps=1e12, nvlink_gbps=1e12, pcie_gbps=1e12, ssd_gbps=1e12),
    }


HARDWARE_PRESETS = tuple(_presets())


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
    def roofline(params_gb: float, kv_bytes_per_token: int, tp: int, tflops: float = 312.0, hbm_tbps: float = 2.0,
                 mfu: float = 0.5, mbu: float = 0.8, overhead_s: float = 0.002) -> EngineCost:
        """Costs from GPU peak compute and memory bandwidth (see the module docstring)."""
        comm = 1.0 + 0.1 * math.log2(tp)
        flops_per_token = 2 * params_gb * 1e9  # bf16: params = bytes / 2, 2 FLOPs per param
        compute = flops_per_token / 2 / (tp * tflops * 1e12 * mfu) * comm
        read_weights = params_gb * 1e9 / (tp * hbm_tbps * 1e12 * mbu) * comm
        return EngineCost(read_weights + overhead_s, compute, read_weights + overhead_s, compute,
                          kv_bytes_per_token / (tp * hbm_tbps * 1e12 * mbu))

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
    max_context: int = 32768  # prompt + output; longer requests are clipped (and counted)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.layers < 1 or self.max_batch < 1 or self.max_prefill_tokens < 1 or self.max_context < 2:
            raise ValueError(f"model {self.name}: tp, layers, max_batch, max_prefill_tokens must be >= 1 "
                             f"and max_context >= 2")
        if not self.params_gb > 0 or self.kv_bytes_per_token < 1:
            raise ValueError(f"model {self.name}: params_gb and kv_bytes_per_token must be > 0")

    @property
    def bytes(self) -> int:
        return int(self.params_gb * 1e9)

    def layout(self) -> ModelLayout:
        return ModelLayout.uniform(self.name, self.layers, self.bytes)

    def kv_capacity_tokens(self, hw: Hardware) -> int:
        free = (hw.gpu_mem_gb * self.tp - self.params_gb) * 0.9e9
        if free <= 0:
            raise ValueError(f"model {self.name} ({self.params_gb} GB) does not fit {self.tp} x {hw.gpu_mem_gb} GB "
                             f"GPUs (raise --tp)")
        return int(free / self.kv_bytes_per_token)

    def with_tp(self, tp: int) -> ModelSpec:
        """The same model at another tensor-parallel degree (costs re-derived by the roofline)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        return replace(self, tp=tp, cost=EngineCost.roofline(self.params_gb, self.kv_bytes_per_token, tp))


def _models() -> dict[str, ModelSpec]:
    def spec(name: str, gb: float, layers: int, kv_heads: int, head_dim: int, tp: int) -> ModelSpec:
        kv = 2 * kv_heads * head_dim * 2 * layers  # K and V, bf16, every layer
        return ModelSpec(name, gb, layers, kv, EngineCost.roofline(gb, kv, tp), tp)

    return {
        # Llama-3-8B: 32 layers, GQA 8 KV heads x 128 dims: 128 KiB of KV per token.
        "llama3-8b": spec("llama3-8b", 16.0, 32, 8, 128, 1),
        # Mistral-Small-24B: 40 layers, 8 KV heads x 128 dims.
        "mistral-24b": spec("mistral-24b", 48.0, 40, 8, 128, 2),
        # Qwen2-72B: 80 layers, 8 KV heads x 128 dims, 145 GB in bf16: four GPUs per instance.
        "qwen-72b": spec("qwen-72b", 145.0, 80, 8, 128, 4),
    }


MODEL_PRESETS = tuple(_models())


def model(name: str, tp: int | None = None) -> ModelSpec:
    presets = _models()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r} (choose {', '.join(presets)})")
    spec = presets[name]
    return spec.with_tp(tp) if tp is not None and tp != spec.tp else spec
