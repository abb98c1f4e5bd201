"""KV cache: per sequence, per layer, the keys and values of every token seen so far.

Data flow: `SequenceKV.append(layer, start, k, v)` stores new positions and returns the full K/V of
that layer. Only layers an engine executes get entries, which is how a split run keeps its KV cache
split: the loading engine B holds the KV of layers 0..k-1, the full engine A the KV of layers k..L-1,
and each decode step runs the same split again (B first, activations to A), so neither side ever
needs the other's cache. The token budget for admission lives in the scheduler (`Limits.kv_tokens`).
"""

from __future__ import annotations

import torch


class SequenceKV:
    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def length(self, layer: int) -> int:
        kv = self.layers.get(layer)
        return 0 if kv is None else int(kv[0].shape[1])

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        have = self.length(layer)
        if start != have:
            raise RuntimeError(f"layer {layer}: KV holds {have} positions, new tokens start at {start}")
        old = self.layers.get(layer)
        if old is not None:
            k, v = torch.cat((old[0], k), dim=1), torch.cat((old[1], v), dim=1)
        self.layers[layer] = (k, v)
        return k, v

    def tokens(self) -> int:
        return max((kv[0].shape[1] for kv in self.layers.values()), default=0)

