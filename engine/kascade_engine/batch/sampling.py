"""Sampling: next token from logits, greedy (temperature 0) or temperature / top-p with a seeded
generator so a request with a seed is reproducible."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None = None) -> int:
    """`logits` [V] float32 -> token id."""
    if p.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen).item())
