"""The in-process half of the GPU smoke test (bench/gpu_smoke.py): the engine's core and transformers
on one device in this process.

- `attention_backends(ckpt, device, dtype)`: the engine's own `scaled_dot_product_attention` calls,
  recorded while it decodes, each replayed under every SDPA backend alone (flash, memory-efficient,
  cuDNN, math) -> which backends accept the engine's actual calls (it passes a boolean mask: flash
  cannot take one) and torch's flash / mem-efficient switches and availability.
- `step_times(ckpt, device, dtype, batches, new)`: decode step seconds at each batch size, the engine's
  `Engine.step()` (all sequences decoding) against transformers' model forward with its KV cache, one
  token per sequence per step (both after the prompt's prefill, both greedy).
- `upload_gbps(device, mb)`: host -> device copy GB/s from pinned and from pageable memory.
Every tensor made here names its device.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(ckpt: Path, device: torch.device, dtype: torch.dtype, max_seqs: int = 64) -> Any:
    from kascade_engine.batch.engine import Engine
    from kascade_engine.batch.model import LlamaModel
    from kascade_engine.batch.scheduler import Limits
    from kascade_engine.weights.blocks import pack_checkpoint

    blocks = pack_checkpoint(ckpt)
    eng = Engine(LlamaModel(blocks.config, dtype=dtype, device=device),
                 Limits(max_batch_tokens=4096, max_seqs=max_seqs, kv_tokens=max_seqs * 256))
    eng.load_blocks(blocks.blocks.values())
    return eng


def attention_backends(ckpt: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Which SDPA backends accept the engine's actual attention calls (one decode and one prefill)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kascade_engine.batch import attention
    from kascade_engine.batch.sampling import SamplingParams

    eng = make_engine(ckpt, device, dtype, max_seqs=4)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real = F.scaled_dot_product_attention

    def record(*a: Any, **kw: Any) -> torch.Tensor:
        if len(calls) < 64:
            calls.append((a, kw))
        return real(*a, **kw)

    F.scaled_dot_product_attention = record  # type: ignore[assignment]  # the model calls F.<name> at run time
    try:
        eng.generate_many([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=3))
    finally:
        F.scaled_dot_product_attention = real  # type: ignore[assignment]
    if not calls:
        raise RuntimeError("the engine made no scaled_dot_product_attention call")
    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    accepted: dict[str, bool] = {}
    for name, backend in names.items():
        ok = True
        for a, kw in calls:
            try:
                with sdpa_kernel([backend]):
                    real(*a, **kw)
            except RuntimeError:
                ok = False
                break
        accepted[name] = ok
    q, _k, _v = calls[0][0][:3]
    mask = calls[0][1].get("attn_mask")
    # torch's own preference order on CUDA: flash, then memory-efficient, then math (cuDNN where enabled first)
    order = ["cudnn", "flash", "efficient", "math"] if device.type == "cuda" else ["flash", "math"]
    picked = next((n for n in order if accepted[n]), None)
    out: dict[str, Any] = {
        "engine_sdpa_calls": len(calls), "engine_passes_mask": mask is not None,
        "engine_mask_dtype": None if mask is None else str(mask.dtype).removeprefix("torch."),
        "engine_attention_device": str(q.device), "engine_attention_dtype": str(q.dtype).removeprefix("torch."),
        "backends_accepting_engine_calls": accepted, "engine_backend_torch_would_pick": picked,
        # the decode kernel: "flashinfer" (paged, CUDA, installed: its calls are not SDPA calls) or "torch" (SDPA)
        "engine_decode_kernel": attention.backend(device),
    }
    if device.type == "cuda":
        b = torch.backends.cuda
        out.update(
            {
                "flash_sdp_enabled": b.flash_sdp_enabled(),
                "mem_efficient_sdp_enabled": b.mem_efficient_sdp_enabled(),
                "math_sdp_enabled": b.math_sdp_enabled(),
                "cudnn_sdp_enabled": getattr(b, "cudnn_sdp_enabled", lambda: None)(),
                "flash_attention_available": getattr(b, "is_flash_attention_available", lambda: None)(),
            }
        )
    return out


def engine_step_s(eng: Any, batch: int, new: int, device: torch.device) -> float:
    """Seconds per decode step with `batch` sequences decoding (prefill done before the clock starts)."""
    from kascade_engine.batch.sampling import SamplingParams

    for i in range(batch):
        eng.submit([1 + (i * 7 + j) % 50 for j in range(8)], SamplingParams(max_tokens=new + 4))
    while any(len(r.out) == 0 for r in eng.requests.values()):  # every prompt prefilled: decodes only from here
        eng.step()
    sync(device)
    t0, steps0 = time.perf_counter(), eng.steps
    while eng.steps - steps0 < new:
        eng.step()
    sync(device)
    dt = (time.perf_counter() - t0) / (eng.steps - steps0)
    while eng.requests:  # drain, freeing the pages for the next batch size
        eng.step()
    return dt


def hf_step_s(model: Any, batch: int, new: int, device: torch.device) -> float:
    """transformers' seconds per decode step at `batch`: the model's forward with its KV cache, one token per
    sequence per step, greedy (a bare decode loop: `generate`'s own bookkeeping would only add to it)."""
    ids = torch.tensor([[1 + (i * 7 + j) % 50 for j in range(8)] for i in range(batch)], device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(device)
    return (time.perf_counter() - t0) / new


def step_times(ckpt: Path, device: torch.device, dtype: torch.dtype, batches: list[int], new: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    eng = make_engine(ckpt, device, dtype, max_seqs=max(batches))
    engine_step_s(eng, 1, 2, device)  # warm-up
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    hf_step_s(hf, 1, 2, device)  # warm-up
    graphs = eng.graphs  # decode CUDA graphs (batch/graphs.py): None off CUDA or with FlashInfer
    out: dict[str, Any] = {"engine_cuda_graphs": graphs is not None}
    for b in batches:
        e, h = engine_step_s(eng, b, new, device), hf_step_s(hf, b, new, device)
        out[f"engine_step_ms_b{b}"], out[f"hf_step_ms_b{b}"] = 1e3 * e, 1e3 * h
        out[f"engine_over_hf_step_time_b{b}"] = e / h if h > 0 else None
        line = f"  decode step b{b}: engine {1e3 * e:.2f} ms, transformers {1e3 * h:.2f} ms"
        if graphs is not None:  # the same steps eagerly: what the graphs save
            eng.graphs = None
            eager = engine_step_s(eng, b, new, device)
            eng.graphs = graphs
            out[f"engine_eager_step_ms_b{b}"] = 1e3 * eager
            line += f", engine without CUDA graphs {1e3 * eager:.2f} ms"
        print(line, flush=True)
    return out


def upload_gbps(device: torch.device, mb: int, reps: int = 3) -> dict[str, Any]:
    """Host -> `device` copy GB/s, pinned and pageable source (best of `reps`)."""
    n = mb << 20
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"upload_mb": mb, "upload_device": str(dst.device)}
    for kind in ("pinned", "pageable"):
        src = torch.ones(n, dtype=torch.uint8, device="cpu", pin_memory=kind == "pinned" and device.type == "cuda")
        best = float("inf")
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out[f"upload_gbps_{kind}"] = n / best / 1e9
        out[f"upload_{kind}_is_pinned"] = bool(src.is_pinned()) if device.type == "cuda" else False
    if not bool(dst[-1] == 1):
        raise RuntimeError("upload check: the last byte on the device is not the host's")
    return out
