"""Activation frames: a split's hidden rows on the wire (a JSON header naming shape and dtype, then the raw
tensor bytes, row-major, little endian; never pickle). The per-request split (split.py) and the pair
sessions (pairsession.py) both speak it; its own module so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.net.transport import Header

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def encode_activation(
    req: str, start: int, layer: int, hidden: torch.Tensor, params: SamplingParams
) -> tuple[Header, bytes]:
    name = str(hidden.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"activation dtype {name} not supported")
    raw = hidden.contiguous().cpu().view(torch.uint8).numpy().tobytes() if hidden.numel() else b""
    p = {k: v for k, v in asdict(params).items() if k in ("temperature", "top_p", "seed")}
    return {"op": "act", "req": req, "start": start, "layer": layer, "shape": list(hidden.shape),
            "dtype": name, "params": p}, raw


def decode_activation(header: Header, payload: bytes | bytearray, hidden_size: int) -> torch.Tensor:
    shape, dtype = header.get("shape"), header.get("dtype")
    if dtype not in DTYPES:
        raise ValueError(f"activation dtype {dtype!r} not supported")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) and x > 0 for x in shape)):
        raise ValueError(f"activation shape {shape!r} must be [tokens, hidden]")
    if shape[1] != hidden_size:
        raise ValueError(f"activation hidden size {shape[1]} != model hidden size {hidden_size}")
    t = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    want = shape[0] * shape[1] * torch.empty(0, dtype=DTYPES[dtype]).element_size()
    if t.numel() != want:
        raise ValueError(f"activation payload has {t.numel()} bytes, shape {shape} {dtype} needs {want}")
    return t.view(DTYPES[dtype]).view(shape[0], shape[1])
