"""Logprobs in OpenAI's response shapes: per choice, the sampled tokens' logprobs (the model's own
distribution, before penalties) and their top alternatives, as `/v1/completions` (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) or `/v1/chat/completions` (`content`: token, logprob,
bytes, top_logprobs) give them; a streamed chunk carries the entries of the tokens it answers.

Data flow: `Event.logprob` (batch.sampling.pick) -> `ChoiceLogprobs.add` -> an entry -> `doc(entries)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kascade_engine.batch.sampling import TokenLogprob


class ChoiceLogprobs:
    def __init__(self, decode: Callable[[list[int]], str], chat: bool) -> None:
        self.decode, self.chat = decode, chat
        self.offset = 0  # completions' text_offset: characters of the token strings so far
        self.entries: list[dict[str, Any]] = []

    def add(self, token: int, lp: TokenLogprob) -> dict[str, Any]:
        """One sampled token's entry (kept for the whole choice, and returned for its chunk)."""
        text = self.decode([token])
        logprob, alts = lp
        top = [(self.decode([t]), v) for t, v in alts]
        if self.chat:
            e: dict[str, Any] = {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top],
            }
        else:
            best: dict[str, float] = {}
            for t, v in top:  # tokens that decode alike share a key: the likelier one keeps it
                best.setdefault(t, v)
            e = {"token": text, "logprob": logprob, "top": best, "offset": self.offset}
            self.offset += len(text)
        self.entries.append(e)
        return e

    def doc(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": [e["offset"] for e in entries]}
