"""Tiny real tokenizers trained offline in well under a second, for tests: a SentencePiece BPE with
byte fallback written as a lone `tokenizer.model` (the layout of Llama-2/Mistral checkpoints that ship no
tokenizer.json), and a byte-level BPE (GPT-2/Llama-3/SmolLM2 style). Both split multi-byte UTF-8
characters across tokens, which is what incremental detokenization must get right.

Data flow: a small built-in multilingual corpus -> trainer -> file in a checkpoint directory / a
`tokenizers.Tokenizer` object.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Kascade scales models live.",
    "Héllo wörld, naïve café — “quotes” and ‘apostrophes’ déjà vu.",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "Emoji: 🎉 🚀 👩‍💻 and math ∑ ∫ √ ≤ ≥.",
)


def sentencepiece_model(out: Path, vocab: int = 400) -> Path:
    """Write `out/tokenizer.model` (SentencePiece BPE, byte fallback, unk=0 bos=1 eos=2); needs the
    `sentencepiece` package to train and transformers needs `protobuf` to read it."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 20), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.98,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    return out / "tokenizer.model"


def byte_level_bpe(vocab: int = 400) -> Any:
    """A transformers fast tokenizer over a byte-level BPE trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    # transformers leaves TokenizersBackend.__init__ unannotated
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")  # type: ignore[no-untyped-call]
