"""Sampling: next token from logits, greedy (temperature 0) or temperature / top-k / top-p with a seeded
generator so a request with a seed is reproducible; before that, the logit processors OpenAI and vLLM
clients send (repetition / frequency / presence penalties, min_tokens), applied to a whole step's rows
at once.

Data flow: a step's logits [B, V] -> `adjust` (only rows whose request needs it: penalties over the
tokens seen so far, stop tokens masked until min_tokens) -> argmax (greedy rows), `sample_rows` for every
unseeded sampling row at once on the device, or `sample` per row with the request's seeded CPU generator
-> one device -> host copy of the step's tokens.
With default parameters no row is touched, so greedy output stays the model's own argmax.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0: off
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    ignore_eos: bool = False  # EOS does not end the request (stop_token_ids still do)
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output tokens, divides positive logits
    frequency_penalty: float = 0.0  # OpenAI's: minus this per occurrence in the output
    presence_penalty: float = 0.0  # OpenAI's: minus this once for any token in the output
    logprobs: int | None = None  # report the sampled token's logprob and this many top alternatives (None: off)

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def needs_adjust(p: SamplingParams, generated: int) -> bool:
    """Whether a row's logits must pass `adjust` before it picks (never with defaults)."""
    return p.penalised or generated < p.min_tokens


def adjust(logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, list[int], list[int]]],
           eos: int | None) -> torch.Tensor:
    """`logits` [B, V] of the rows (params, prompt, output), penalised and masked, as float32 (a copy)."""
    out = logits.float().clone()
    b, v = out.shape
    dev = out.device
    rep = torch.tensor([p.repetition_penalty for p, _, _ in rows], device=dev).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p, _, _ in rows], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p, _, _ in rows], device=dev).unsqueeze(1)
    counts = _counts([o for _, _, o in rows], b, v, dev)
    seen = _counts([pr + o for _, pr, o in rows], b, v, dev) > 0
    out = torch.where(seen & (rep != 1.0), torch.where(out > 0, out / rep, out * rep), out)
    out = out - freq * counts - pres * (counts > 0).float()
    for j, (p, _, o) in enumerate(rows):
        if len(o) < p.min_tokens:
            masked: Collection[int] = set(p.stop_token_ids) | ({eos} if eos is not None and not p.ignore_eos else set())
            ids = [t for t in masked if 0 <= t < v]
            if ids:
                out[j, ids] = float("-inf")
    return out


def _counts(seqs: list[list[int]], b: int, v: int, dev: torch.device) -> torch.Tensor:
    """[B, V] float32: how often each token id occurs in each row's sequence (one scatter for the batch)."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(b, v + 1, device=dev)  # column v takes the padding
    if width:
        idx = torch.full((b, width), v, dtype=torch.long)
        for j, s in enumerate(seqs):
            if s:
                idx[j, :len(s)] = torch.tensor(s, dtype=torch.long).clamp_(0, v)
        counts.scatter_add_(1, idx.to(dev), torch.ones(b, width, device=dev))
    return counts[:, :v]


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None = None) -> int:
    """`logits` [V] float32 -> token id."""
    if p.temperature <= 0:
        return int(torch.argmax(logits).item())
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample_rows(logits: torch.Tensor, ps: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` [B, V] -> [B] token ids, each row with its own temperature, top-k and top-p, in a fixed number of
    ops on the logits' device whatever B is (one sort; the device's default generator: rows without a seed).
    Top-k keeps the k highest-ranked tokens, top-p the smallest prefix of them whose mass reaches p."""
    dev = logits.device
    v = logits.shape[-1]
    temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)[:, None]
    k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in ps], dtype=torch.long, device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)[:, None]
    sv, si = torch.sort(logits.float() / temp, dim=-1, descending=True)
    rank = torch.arange(v, device=dev)[None, :]
    probs = torch.softmax(sv.masked_fill(rank >= k, float("-inf")), dim=-1)
    probs = probs.masked_fill((torch.cumsum(probs, -1) - probs >= top_p) & (rank > 0), 0.0)
    return si.gather(1, torch.multinomial(probs, 1))[:, 0]


def stops_here(p: SamplingParams, tok: int, eos: int | None, generated: int) -> bool:
    """Whether `tok`, the request's `generated`-th token, ends it (EOS unless ignore_eos; a stop token id),
    never before min_tokens."""
    if generated < p.min_tokens:
        return False
    return (tok == eos and not p.ignore_eos) or tok in p.stop_token_ids


EXTRAS = ("top_k", "min_tokens", "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty",
          "logprobs")


def extras(p: SamplingParams) -> dict[str, float | int | bool]:
    """The parameters beyond temperature / top_p / seed that differ from the defaults (for wire formats)."""
    d = SamplingParams()
    return {k: getattr(p, k) for k in EXTRAS if getattr(p, k) != getattr(d, k)}


def with_extras(p: SamplingParams, d: object) -> SamplingParams:
    """`p` with `extras(...)` from a peer applied; ValueError names a bad one."""
    if not isinstance(d, dict) or any(k not in EXTRAS for k in d):
        raise ValueError(f"sampling extras {d!r}: expected a dict of {', '.join(EXTRAS)}")
    kinds = {"top_k": int, "min_tokens": int, "ignore_eos": bool, "logprobs": int}
    try:
        return replace(p, **{k: kinds.get(k, float)(v) for k, v in d.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"sampling extras {d!r}: {e}") from None


class Sampled(Protocol):
    """What picking a request's next token needs of it (batch.engine.Request has these)."""
    params: SamplingParams
    prompt: list[int]
    out: list[int]
    gen: torch.Generator | None
    lp: TokenLogprob | None  # set by `pick` for a request that asked for logprobs


TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]  # the sampled token's logprob, the top (id, logprob)s


def pick(logits: torch.Tensor, reqs: Sequence[Sampled | tuple[SamplingParams, torch.Generator | None]],
         eos: int | None) -> list[int]:
    """`logits` [B, V] -> one token per row. A request's row gets its penalties and min_tokens (`adjust`, in one
    pass over the rows that need it); a (params, generator) row (a live peer's: it keeps the history) only its
    temperature / top-k / top-p. Greedy rows take the argmax."""
    raw = logits  # logprobs are the model's own distribution (vLLM's default), before penalties
    params: list[SamplingParams] = []
    fix: list[int] = []  # rows whose logits pass `adjust`
    free: list[int] = []  # unseeded sampling rows
    seeded: list[tuple[int, torch.Generator]] = []  # sampling rows with their own generator
    want: list[int] = []  # rows that report logprobs
    for j, r in enumerate(reqs):  # one pass: a greedy batch of defaults costs a few checks per row
        if isinstance(r, tuple):
            p, gen = r
        else:
            p, gen = r.params, r.gen
            if p.penalised or len(r.out) < p.min_tokens:  # needs_adjust
                fix.append(j)
            if p.logprobs is not None:
                want.append(j)
        params.append(p)
        if p.temperature > 0:
            if gen is None:
                free.append(j)
            else:
                seeded.append((j, gen))
    if fix:
        logits = logits.clone()
        rows = [(r.params, r.prompt, r.out) for r in (reqs[j] for j in fix) if not isinstance(r, tuple)]
        logits[fix] = adjust(logits[fix], rows, eos).to(logits.dtype)
    picked = logits.argmax(dim=-1)
    if free:  # unseeded sampling rows: one vectorised draw on the logits' device
        idx = torch.tensor(free, dtype=torch.long, device=logits.device)
        picked = picked.index_copy(0, idx, sample_rows(logits.index_select(0, idx), [params[j] for j in free]))
    out: list[int] = picked.tolist()  # the step's one device -> host copy of tokens
    for j, g in seeded:  # a seed: its own CPU generator, same tokens on any device
        out[j] = sample(logits[j].float().cpu(), params[j], g)
    if want:
        lps = torch.log_softmax(raw[want].float(), dim=-1).cpu()
        for k, j in enumerate(want):
            r = reqs[j]
            assert not isinstance(r, tuple)
            n = min(r.params.logprobs or 0, lps.shape[1])
            top = torch.topk(lps[k], n) if n else None
            alts = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            r.lp = (float(lps[k, out[j]]), alts)
    return out
