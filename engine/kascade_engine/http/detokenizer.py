"""Incremental detokenizer: the text each new token adds, at a cost that does not grow with the length
of the generation.

Decoding the whole token list on every token costs O(n) per token (O(n²) per request). Instead we
decode only a short tail window of tokens, twice: `tokens[prefix:read]` (text already released) and
`tokens[prefix:]` (that plus the new tokens); the new text is the difference. The window starts one
release back rather than at the new token itself because tokenizers decode a token differently at the
start of a text (SentencePiece drops the leading "▁" space, byte-level BPE may merge bytes across
tokens), and both decodes see the same start, so the start-of-text rule cancels out. A tail that ends in
U+FFFD is an incomplete UTF-8 character (byte-fallback or byte-level tokens split one character): it is
held until the token that completes it arrives, so no replacement character is ever streamed for it.
Byte-fallback tokens (SentencePiece `<0xNN>`, given as `hold`) are held too: the tokenizers decoder
turns a whole run of them into U+FFFD when the run is not valid UTF-8, so bytes that read as ASCII
now may become U+FFFD once the next byte token arrives; a run is released when a token that is not a
byte token ends it. On the last token whatever is held is flushed, so the concatenated pieces equal a
full `decode` of the generated tokens.

Data flow: token id -> `push(token, last)` -> released text piece (possibly "").
"""

from __future__ import annotations

from collections.abc import Callable, Collection

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Released text of one generated sequence, one token at a time; the window never grows past the
    tokens of one incomplete character plus the previous release."""

    def __init__(self, decode: Callable[[list[int]], str], hold: Collection[int] = ()) -> None:
        self.decode = decode
        self.hold = hold  # byte-fallback token ids: a run of them is released only once it ended
        self.tokens: list[int] = []
        self.prefix = 0  # window start: the first token of the previous release
        self.read = 0  # tokens before this are released as text

    def push(self, token: int, last: bool = False) -> str:
        """The text this token releases (possibly empty until a multi-byte character completes)."""
        self.tokens.append(token)
        if not last and token in self.hold:
            return ""  # inside a run of byte tokens: its text depends on the bytes still to come
        window = self.tokens[self.prefix:]
        before = self.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.decode(window)
        if not last and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""  # nothing new yet, or a character still incomplete: wait for the next token
        piece = after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        return piece

    @property
    def window(self) -> int:
        """Tokens decoded per push right now (bounded; a test watches it)."""
        return len(self.tokens) - self.prefix
