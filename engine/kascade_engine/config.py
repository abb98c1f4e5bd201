"""EngineConfig: everything an engine instance is started with, frozen, built once from CLI flags / env
(`kascade engine serve`) or directly by tests; `bind` may only narrow it (`with_dtype`).

Data flow: flags -> `EngineConfig(...)` (validated: a bad value names its flag) -> `EngineInstance`
reads it; the device string resolves once (`auto` -> `cuda` when torch sees a GPU, else `cpu`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kascade_engine.net.transport import (
    AF41,
    TRANSPORTS,
    TrafficClass,
    Transport,
    activation_class,
)
from kascade_engine.net.transports import make_transport

if TYPE_CHECKING:
    from kascade_engine.net.transport_tls import TlsFiles

DTYPES = ("bfloat16", "float16", "float32")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


CPU_KV_TOKENS = 65536  # the CPU's KV capacity when --kv-tokens is not given (memory mapped as it is used)


class ConfigError(ValueError):
    """A bad engine setting; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    checkpoint: Path
    model_name: str
    token: str
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, the checkpoint's 16-bit type on CUDA) | bfloat16 | float16 | float32
    max_prompt_tokens: int = 0  # 0: the model's context (max_position_embeddings), set by `resolved`
    max_batch_tokens: int = 512  # per-step token budget: decodes + prefill chunks
    max_seqs: int = 64
    # paged KV capacity in tokens (rounded up to whole pages); 0: CPU_KV_TOKENS on the CPU, on CUDA what
    # --gpu-memory-utilization of the device leaves after the weights (kvcache.kv_tokens_for_memory); `resolved`
    kv_tokens: int = 0
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True  # CUDA: decode steps replayed as graphs per batch-size bucket (batch/graphs.py)
    page_size: int = 16
    max_n: int = 8  # OpenAI `n` limit
    # load shedding: prompt tokens that may wait for a first step; a request beyond it is a 503 + Retry-After
    # (an empty queue admits any one prompt). Unbounded, 300 requests on 8 slots all queued (issue 38).
    max_waiting_tokens: int = 65536
    threads: int = 1
    transport: str = "tcp"  # the data plane's transport: weights, activations and KV (one of TRANSPORTS)
    transfer_bytes_per_s: float | None = None
    empty: bool = False
    resident_layers: int | None = None
    instance: str = "engine-0"
    emulate_layer_ms: float = 0.0  # benchmarks: a step's layer work takes at least this per layer (an accelerator)
    emulate_knee_tokens: int = 0  # with it: a layer forward over more tokens than this costs proportionally more
    tls: TlsFiles | None = None  # mutual TLS for every data-plane TCP connection (weights, activations, KV)
    host_cache_bytes: int = 0  # a released engine keeps its weights in host memory up to this (0: never)
    # the node cache (weights/nodecopy.py, ADR 16): a memory-backed directory shared by the node's engines, where
    # the node keeps one copy per model that every engine maps (None: each engine holds its own host copy), and
    # the node's budget for those copies (unused ones are evicted, least recently attached first, to fit it)
    node_cache_dir: Path | None = None
    node_cache_bytes: int = 16 << 30
    # DSCP class of the act port's TCP connections (activations, pair steps, PD KV) and of the HTTP port's
    # (the tokens streamed to clients), so a QoS fabric sends them ahead of weight streams (unmarked); 0: no
    # mark (transport.py, "Traffic classes")
    activation_dscp: int = AF41
    # tensor parallel: ranks of this instance, one process each (tp/); rank 0 is this process and serves HTTP
    tp: int = 1
    # X-Kascade-Prefill(-Fallback) honoured only with the router's signature (X-Kascade-Prefill-Sig, keyed by
    # `token`): a client reaching the HTTP port directly cannot make a decode engine dial any host:port
    require_prefill_signature: bool = False

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ConfigError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: use auto, {', '.join(DTYPES)}")
        for name in ("max_prompt_tokens", "kv_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (or 0: automatic), "
                                  f"got {getattr(self, name)}")
        for name in ("max_batch_tokens", "max_seqs", "page_size", "max_n", "threads", "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.host_cache_bytes < 0:
            raise ConfigError(f"--host-cache-gib must be >= 0, got {self.host_cache_bytes / 2**30:g}")
        if self.node_cache_bytes < 0:
            raise ConfigError(f"--node-cache-gib must be >= 0, got {self.node_cache_bytes / 2**30:g}")
        if self.node_cache_dir is not None and self.tp > 1:
            raise ConfigError("--node-cache-dir with --tp > 1: a tensor-parallel instance's ranks hold weight planes, "
                              "the node cache holds whole models (not built for tp yet)")
        if not 0 <= self.emulate_layer_ms <= 10_000:
            raise ConfigError(f"--emulate-layer-ms must be in [0, 10000], got {self.emulate_layer_ms}")
        if not 0 <= self.emulate_knee_tokens <= 1 << 20:
            raise ConfigError(f"--emulate-knee-tokens must be in [0, 1048576], got {self.emulate_knee_tokens}")
        if not 0 <= self.activation_dscp <= 63:
            raise ConfigError(f"--activation-dscp must be in [0, 63] (0: no mark), got {self.activation_dscp}")
        if not 1 <= self.tp <= 64:
            raise ConfigError(f"--tp must be in [1, 64], got {self.tp}")
        if self.tp > 1 and self.resident_layers is not None and self.empty:
            raise ConfigError("--tp > 1 with --resident-layers and --empty: the layer prefix is taken from "
                              "--checkpoint at start (every rank keeps its slices of embed and those layers)")
        if self.tp > 1 and self.empty and self.tls is not None:
            raise ConfigError("--tp > 1 with --empty and --tls-*: the ranks' plane transfers are plain TCP (TLS for "
                              "them is not built yet)")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--transport {self.transport!r}: unknown transport; use {' or '.join(TRANSPORTS)}")
        if self.tls is not None and self.transport != "tcp":
            raise ConfigError("--tls-cert/--tls-key/--tls-ca apply to --transport tcp only; ucx does not encrypt")
        if not self.token:
            raise ConfigError("no control token: pass --token-file or set KASCADE_ENGINE_TOKEN")

    def activation_transport(self) -> Transport:
        """The act port's transport (activations, pair steps, PD KV), its TCP sockets marked with the
        activation DSCP class (`--activation-dscp`; 0 leaves them unmarked)."""
        return make_transport(self.transport, self.tls, self.latency_class())

    def latency_class(self) -> TrafficClass | None:
        """The class of everything but weights (`--activation-dscp`; None: unmarked): the act port's
        connections and the HTTP listener's (transport.serving_socket)."""
        return activation_class(self.activation_dscp)

    def weight_transport(self) -> Transport:
        """A load plan's transport (weight blocks, bulk): never marked, so a fabric that honours the
        activation class queues weights behind activations on a shared link."""
        return make_transport(self.transport, self.tls, None)

    def resolved(self, model_cfg: dict[str, Any], kv_tokens_auto: Callable[[], int]) -> EngineConfig:
        """This config with its automatic settings made concrete: the longest prompt is the model's context
        (max_position_embeddings) unless --max-prompt-tokens says otherwise; the KV capacity --kv-tokens, else
        CPU_KV_TOKENS on the CPU, else `kv_tokens_auto()` (CUDA: from the device's free memory)."""
        prompt = self.max_prompt_tokens or int(model_cfg.get("max_position_embeddings") or 4096)
        kv = self.kv_tokens or (CPU_KV_TOKENS if self.torch_device().type == "cpu" else kv_tokens_auto())
        return replace(self, max_prompt_tokens=prompt, kv_tokens=kv)

    def with_dtype(self, dtype: str) -> EngineConfig:
        return replace(self, dtype=dtype)

    def torch_device(self) -> Any:
        """The torch.device this engine computes on (resolved once per call; cheap)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: torch sees no CUDA device")
        return torch.device(self.device)

    def torch_dtype(self, model_cfg: dict[str, Any] | None = None) -> Any:
        import torch

        name = self.dtype
        if name == "auto":
            if self.torch_device().type == "cpu":
                name = "float32"  # CPUs here have no fast 16-bit matmul; fp32 is also the exact reference
            else:
                name = str((model_cfg or {}).get("torch_dtype") or (model_cfg or {}).get("dtype") or "bfloat16")
                name = name if name in ("bfloat16", "float16") else "bfloat16"
        return getattr(torch, name)
