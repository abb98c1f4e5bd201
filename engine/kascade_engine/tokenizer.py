"""Tokenizer: the checkpoint's own (transformers AutoTokenizer from the checkpoint directory), or a
byte-level fallback for random test models that ship none.

Data flow: text / chat messages -> `encode` / `chat_prompt` -> token ids -> ... -> `decode`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (ids >= 256 decode to nothing)."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class HFTokenizer:
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(i) for i in out]
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def load_tokenizer(checkpoint: Path | None) -> Tokenizer:
    if checkpoint is not None and any((checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(checkpoint))
    return ByteTokenizer()
