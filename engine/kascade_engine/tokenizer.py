"""Tokenizer: the checkpoint's own (transformers AutoTokenizer from the checkpoint directory), or a
byte-level fallback for random test models that ship none.

Data flow: text / chat messages -> `encode` / `chat_prompt` -> token ids -> ... -> `decode`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


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
        backend = getattr(tok, "_tokenizer", None)
        # streaming decodes a few tokens per generated token: the Rust tokenizer gives the same text ~5x
        # faster than transformers' wrapper, which on top only cleans up spaces before punctuation
        # when `clean_up_tokenization_spaces` is set (then we keep the wrapper)
        self._fast = None if backend is None or getattr(tok, "clean_up_tokenization_spaces", False) else backend.decode
        # SentencePiece byte fallback: `<0xNN>` tokens (the detokenizer holds runs of them, detokenizer.py)
        self.byte_tokens = frozenset(i for t, i in tok.get_vocab().items() if _BYTE_TOKEN.match(t))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return str(self._fast(ids, skip_special_tokens=True))
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(i) for i in out]
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


class TokenizerError(ValueError):
    pass


def load_tokenizer(checkpoint: Path | None) -> Tokenizer:
    if checkpoint is not None and any(
        (checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        if (checkpoint / "tokenizer.model").exists() and not (checkpoint / "tokenizer.json").exists():
            _need_sentencepiece(checkpoint)

        return HFTokenizer(AutoTokenizer.from_pretrained(checkpoint))
    return ByteTokenizer()


def _need_sentencepiece(checkpoint: Path) -> None:
    """A checkpoint with only tokenizer.model (Llama-2/Mistral layout): transformers converts it with
    `sentencepiece` + `protobuf`; without them it falls back to reading the file as tiktoken and fails
    with a message about tiktoken, so say what is really missing."""
    import importlib.util

    def importable(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:  # google.protobuf without google
            return False

    missing = [pkg for pkg, mod in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
               if not importable(mod)]
    if missing:
        raise TokenizerError(f"{checkpoint / 'tokenizer.model'}: a SentencePiece tokenizer without tokenizer.json "
                             f"needs the {' and '.join(missing)} package(s) (kascade's engine extra installs them)")
